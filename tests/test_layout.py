"""The house's shape, measured from the code (docs/architecture.md): no import circle between modules
or packages, no module over 700 lines, a knob's default written in one file, thin Ray actors, and
folders that show the layout (tests/ and scripts/ in folders, docs/architecture.md naming every
package). Pure: reads the source with `ast`, imports nothing of the project."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlhf_orch"
SOURCES = ("rlhf_orch", "launchers")

MAX_MODULE_LINES = 700
MAX_SHARED_DEFAULTS = 30  # (name, default) pairs written in two or more files of rlhf_orch/
MAX_ACTOR_METHODS = 30
ACTORS = ("VLLMEngine", "PolicyWorker")
MAX_TOP_TEST_FILES = 20
MAX_TOP_SCRIPTS = 10

# The layers of docs/architecture.md, bottom first: a package imports only packages of its own layer
# or below.
LAYERS = {
    **dict.fromkeys(("rlhf_orch.one_line", "rlhf_orch.rng", "rlhf_orch.liveness", "rlhf_orch.checkpoint_dirs"), 0),
    "rlhf_orch.cuda_probe": 0,
    **dict.fromkeys(("rlhf_orch.algo", "rlhf_orch.data", "rlhf_orch.topology", "rlhf_orch.reproduce"), 1),
    **dict.fromkeys(("rlhf_orch.models", "rlhf_orch.sync"), 2),
    "rlhf_orch.reward": 3,
    **dict.fromkeys(("rlhf_orch.env", "rlhf_orch.transfer"), 4),
    **dict.fromkeys(("rlhf_orch.engines", "rlhf_orch.trainer", "rlhf_orch.logging"), 5),
    **dict.fromkeys(("rlhf_orch.reporting", "rlhf_orch.view", "launchers"), 6),
    "rlhf_orch.config": 7,
    "rlhf_orch.memory": 8,
    "rlhf_orch.orchestration": 9,
    **dict.fromkeys(("rlhf_orch.app", "rlhf_orch"), 10),
}


def _module_files() -> dict[str, Path]:
    modules = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (at any depth of the file: a lazy import is an
    import all the same)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlhf_orch" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in graph.items():
        packages[_package_of(module)].update(_package_of(t) for t in targets if _package_of(t) != _package_of(module))
    return dict(packages)


def shared_defaults() -> dict[tuple[str, str], set[str]]:
    """Every `name: T = literal` field of a class and every `name=literal` parameter default in
    rlhf_orch/ (None/True/False aside), grouped by (name, value): the pairs written in 2+ files."""
    seen: dict[tuple[str, str], set[str]] = collections.defaultdict(set)

    def literal(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = literal(node.operand)
            return None if inner is None else "-" + inner
        if isinstance(node, ast.Constant) and type(node.value) not in (bool, type(None)):
            return repr(node.value)
        return None

    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            pairs: list[tuple[str, ast.AST | None]] = []
            if isinstance(node, ast.ClassDef):
                pairs = [
                    (s.target.id, s.value)
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                ]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                pairs = list(zip((a.arg for a in positional[len(positional) - len(args.defaults) :]), args.defaults))
                pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for name, value in pairs:
                text = literal(value)
                if text is not None:
                    seen[(name, text)].add(where)
    return {pair: files for pair, files in seen.items() if len(files) > 1}


def actor_methods(class_name: str) -> set[str]:
    """The methods (dunders aside) a project class defines or inherits from the project's classes."""
    classes: dict[str, ast.ClassDef] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    methods: set[str] = set()
    todo, done = [class_name], set()
    while todo:
        name = todo.pop()
        if name in done or name not in classes:
            continue
        done.add(name)
        cls = classes[name]
        methods |= {
            s.name
            for s in cls.body
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not (s.name.startswith("__") and s.name.endswith("__"))
        }
        todo += [
            b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))
        ]
    return methods


def test_no_module_imports_itself_in_a_circle():
    assert circles(import_graph()) == []


def test_no_package_imports_itself_in_a_circle():
    assert circles(package_graph(import_graph())) == []


def upward_imports(packages: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a package imports one of a higher layer (or one not placed)."""
    return sorted((a, b) for a, targets in packages.items() for b in targets if LAYERS.get(b, 99) > LAYERS.get(a, -1))


def test_no_package_imports_a_higher_layer():
    packages = package_graph(import_graph())
    assert set(packages) <= set(LAYERS), (
        f"place these in LAYERS (and docs/architecture.md): {set(packages) - set(LAYERS)}"
    )
    assert upward_imports(packages) == []


def test_no_module_over_700_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for top in (*SOURCES, "scripts", "tests")
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_a_default_is_written_in_one_file():
    pairs = shared_defaults()
    listing = "\n".join(f"{name}={value}: {sorted(files)}" for (name, value), files in sorted(pairs.items()))
    assert len(pairs) <= MAX_SHARED_DEFAULTS, f"{len(pairs)} (name, default) pairs in 2+ files:\n{listing}"


@pytest.mark.parametrize("actor", ACTORS)
def test_ray_actor_classes_are_thin(actor):
    methods = actor_methods(actor)
    assert methods, f"{actor} not found"
    assert len(methods) <= MAX_ACTOR_METHODS, sorted(methods)


def test_tests_and_scripts_are_in_folders():
    top_tests = [p.name for p in (ROOT / "tests").glob("*.py")]
    top_scripts = [p.name for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert len(top_tests) <= MAX_TOP_TEST_FILES, sorted(top_tests)
    assert len(top_scripts) <= MAX_TOP_SCRIPTS, sorted(top_scripts)


def test_architecture_page_names_every_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(
        str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts
    ) + ["launchers"]
    missing = [p for p in packages if not re.search(rf"`{re.escape(p)}/?`", page)]
    assert missing == []


def test_the_checks_see_what_they_measure():
    # The measures themselves: a circle, a shared default and an inherited method are found.
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _package_of("rlhf_orch.sync.bucketed") == "rlhf_orch.sync"
    assert upward_imports({"rlhf_orch.sync": {"rlhf_orch.logging", "rlhf_orch.topology"}}) == [
        ("rlhf_orch.sync", "rlhf_orch.logging")
    ]
    assert "progress" in actor_methods("VLLMEngine")
