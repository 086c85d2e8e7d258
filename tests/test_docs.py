"""Docs that cannot rot: what README.md, docs/**/*.md and `python run.py --help` show a researcher is
checked against conf/ and the code.

- every option named in README's config-groups table exists in conf/, and every option in conf/ is in
  the table (and `--help` lists exactly conf/'s options, each with a description);
- every `python run.py ...` command line in README.md, docs/*.md and the help template composes and
  passes the project's checks, planned as a dry run (a GPU layout plans on a machine without GPUs);
  a command shown as refused (`$ python run.py ...` followed by `error: ...`) must be refused with
  that message on a machine without CUDA. `group=<name>` / `group=...` stands for every option of the group;
- every exit code README documents has a test that produces it (`EXIT_CODE_TESTS`).
- every relative link of README.md and docs/ resolves, and every test or script a reference page names
  (README.md, docs/*.md) exists.

`test_the_checker_fails_on_a_stale_command` shows a deliberately broken sample failing the checker.
"""

from __future__ import annotations

import importlib
import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from rlhf_orch.config import help as config_help
from rlhf_orch.config.schema import register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/measurements/ too
HELP_TEMPLATE = CONF / "hydra" / "help" / "rlhf_orch.yaml"
register_configs()


# ----------------------------------------------------------------------------- command lines
@dataclass(frozen=True)
class Command:
    where: str  # file:line
    args: tuple[str, ...]  # what follows `run.py`
    error: str = ""  # the documented refusal (the `error: ...` block under a `$ python run.py` line)

    def __str__(self) -> str:
        return f"{self.where}: python run.py {' '.join(self.args)}"


_RUN = re.compile(r"(?:^|[\s`(=\"'])(?:\$\s+)?(?:(?:\S*/)?python3?\s+)?run\.py(?=\s|$|`)(?P<rest>[^`]*)")
_INLINE = re.compile(r"`([^`\n]+)`")
_MAKE = re.compile(r"make run ARGS=\"(?P<args>[^\"]*)\"")
_PYTHON_RUN = re.compile(r"(?:^|\s|\$\s)(?:\S*/)?python3?\s+run\.py(?=\s|$)")


def _args(rest: str) -> tuple[str, ...]:
    """The arguments after run.py: a trailing `# comment` and `...` dropped."""
    return tuple(a for a in shlex.split(rest, comments=True) if a not in ("...", "\\"))


def extract_commands(text: str, where: str) -> list[Command]:
    """Every `python run.py ...` (and `make run ARGS="..."`) in a markdown text: in code blocks a
    whole line (with `\\` continuations), elsewhere an inline code span. `run.py ...` without
    `python` counts inside inline code only (prose such as "run.py's Hydra function" is not one)."""
    found: list[Command] = []
    lines = text.splitlines()
    in_block = False
    i = 0
    while i < len(lines):
        line, lineno = lines[i], i + 1
        if line.lstrip().startswith("```"):
            in_block = not in_block
            i += 1
            continue
        if in_block:
            joined = line
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i].strip()
            m = _PYTHON_RUN.search(joined)
            if m:
                rest = joined[m.end() :]
                error = ""
                if joined.lstrip().startswith("$") and i + 1 < len(lines) and lines[i + 1].startswith("error:"):
                    error = " ".join(
                        ln.strip()
                        for ln in itertools.takewhile(lambda s: s.strip() and not s.startswith("$"), lines[i + 1 :])
                    )
                found.append(Command(f"{where}:{lineno}", _args(rest), error))
            else:
                for mk in _MAKE.finditer(joined):
                    found.append(Command(f"{where}:{lineno}", _args(mk["args"])))
        else:
            for span in _INLINE.findall(line):
                m = re.match(r"^(?:\$\s+)?(?:(?:\S*/)?python3?\s+)?run\.py(?:\s+(?P<rest>.*))?$", span.strip())
                if m:
                    found.append(Command(f"{where}:{lineno}", _args(m["rest"] or "")))
                    continue
                mk = _MAKE.search(f'{span}"' if span.count('"') == 1 else span)
                if mk:
                    found.append(Command(f"{where}:{lineno}", _args(mk["args"])))
        i += 1
    return found


def _template_commands() -> list[Command]:
    """The examples of the --help template (the lines after `Examples:`)."""
    out = []
    lines = HELP_TEMPLATE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Examples:")
    for n, line in enumerate(lines[start:], start + 1):
        m = _PYTHON_RUN.search(line)
        if m:
            out.append(Command(f"{HELP_TEMPLATE.relative_to(REPO)}:{n}", _args(line[m.end() :])))
    return out


def documented_commands() -> list[Command]:
    cmds = []
    for path in DOCS:
        cmds += extract_commands(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return cmds + _template_commands()


# ----------------------------------------------------------------------------- composing one
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp", "--info"}
_FLAGS = {"-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help"}


class _DryRun:
    """The launcher `check` asks: no GPUs here; a dry run plans for the target cluster's, on a
    machine with CUDA (`cuda`: a docs command may be for a cluster) or without it."""

    dry_run = True
    address = None

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def gpus_present(self) -> int:
        return 0

    def cuda_present(self) -> bool:
        return self.cuda


# Keys naming files or runs on the user's machine (README's /data/gsm8k/train.parquet): a docs
# command is not refused for those not existing here.
MACHINE_KEYS = {
    "model.name_or_path",
    "resume",
    "data.train_files",
    "data.val_files",
    "reward.path",
    "reward.model_path",
    "checkpoint.dir",
}


def job_overrides(args: tuple[str, ...]) -> list[list[str]]:
    """The override lists one command line composes: flags dropped, `a=x,y` sweeps expanded (with
    -m), `group=<name>` / `group=...` as every option of the group."""
    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in _FLAGS_WITH_VALUE:
            skip = True
            continue
        if a in _FLAGS or a.startswith("--cfg="):
            continue
        overrides.append(a)
    choices: list[list[str]] = []
    groups = set(config_help.groups())
    for ov in overrides:
        key, _, value = ov.partition("=")
        bare = key.lstrip("+~")
        if bare in groups and (value == "..." or re.fullmatch(r"<[^>]*>", value)):
            choices.append([f"{key}={o}" for o in config_help.options(bare)])
            continue
        if "<" in value:  # resume=outputs/default/<run>/...: a value to fill in
            ov = f"{key}='{re.sub(r'<[^>]*>', 'placeholder', value)}'"
        parsed = OverridesParser.create().parse_overrides([ov])[0]
        if multirun and parsed.is_sweep_override():
            choices.append([f"{key}={v}" for v in parsed.sweep_string_iterator()])
        else:
            choices.append([ov])
    return [list(combo) for combo in itertools.product(*choices)]


def compose_and_check(args: tuple[str, ...], gpu_machine: bool = True) -> None:
    """Raise what the command line would be refused with: a composition error from Hydra (all that
    `--cfg` and `--help` do), else the ConfigError/PlacementError/... of `rlhf_orch.app.check`,
    planned as a dry run: for the GPUs the plan asks for, on a CUDA machine (`gpu_machine`: a docs
    command may be for a cluster) or on one without CUDA (a refusal the docs show, as on this CPU
    machine). A problem only with a path on the user's machine (`MACHINE_KEYS`) is not one."""
    only_compose = any(a in ("--cfg", "-c", "--help", "-h", "--hydra-help") or a.startswith("--cfg=") for a in args)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides in job_overrides(args):
            error = _job_problem(tuple(overrides), gpu_machine, only_compose)
            if error is not None:
                raise error


_checked: dict[tuple, Exception | None] = {}  # the same job in several docs is checked once


def _job_problem(overrides: tuple[str, ...], gpu_machine: bool, only_compose: bool) -> Exception | None:
    from omegaconf import OmegaConf

    from rlhf_orch import app
    from rlhf_orch.config.validate import ConfigError

    key = (overrides, gpu_machine, only_compose)
    if key in _checked:
        return _checked[key]
    if only_compose and _checked.get((overrides, gpu_machine, False), 1) is None:
        return None  # it passed the checks, so it composes
    error: Exception | None = None
    try:
        cfg = compose(config_name="config", overrides=[*overrides, "launcher.dry_run=true"])
        if only_compose:
            OmegaConf.to_object(cfg)  # the typed schema: what --cfg job prints is a valid config
        else:
            try:
                app.check(cfg, _DryRun(cuda=gpu_machine))
            except ConfigError as e:
                if any(p.key not in MACHINE_KEYS for p in e.problems):
                    raise
    except Exception as e:  # the caller reports it
        error = e
    _checked[key] = error
    return error


def problem(cmd: Command) -> str | None:
    """None when the command does what the docs say (composes, or is refused with its message)."""
    try:
        compose_and_check(cmd.args, gpu_machine=not cmd.error)  # a refusal shown is one on this machine
    except Exception as e:  # any refusal is the finding
        from rlhf_orch.config.hydra_errors import one_line

        message = " ".join(f"{type(e).__name__}: {e}".split())
        shown = " ".join(one_line(e).split())  # what run.py prints for Hydra's own errors
        expected = cmd.error.removeprefix("error:").split("(")[0].replace("```", "").strip()
        if cmd.error and (expected in message or expected in shown):
            return None
        return f"{cmd}\n    -> {message[:400]}"
    if cmd.error:
        return f"{cmd}\n    -> documented as refused ({cmd.error[:80]}...) but it composes and passes the checks"
    return None


def test_docs_show_commands():
    cmds = documented_commands()
    where = {c.where.split(":")[0] for c in cmds}
    assert {"README.md", "docs/sweeps.md", "conf/hydra/help/rlhf_orch.yaml"} <= where, where
    assert len(cmds) >= 30, [str(c) for c in cmds]


def test_every_documented_command_line_composes():
    # Commands that are checked first: one that only composes (--cfg) is then often known to.
    cmds = sorted(documented_commands(), key=lambda c: any(a.startswith(("--cfg", "-c")) for a in c.args))
    # A command line shown in several places (103 shown, 71 distinct) is composed once (~0.5 s each);
    # its problem names every place it is shown.
    places: dict[tuple, list[Command]] = {}
    for c in cmds:
        places.setdefault((c.args, c.error), []).append(c)
    problems = [
        p.replace(str(same[0]), "\n".join(str(c) for c in same), 1)
        for same in places.values()
        if (p := problem(same[0]))
    ]
    assert not problems, "command lines shown to users that do not compose:\n" + "\n".join(problems)


def test_the_checker_fails_on_a_stale_command():
    """A deliberately broken sample: a renamed option, a misspelt key, a schema picked as an option,
    and a refusal the docs promise but that no longer happens."""
    sample = """
Train it: `python run.py sync=gloo_bucketd experiment=quick`.

```bash
.venv/bin/python run.py algo.num_stepz=5          # a misspelt key
.venv/bin/python run.py placement=split_schema    # a schema is not an option
```

```text
$ python run.py sync=gloo_bucketed
error: invalid configuration (1 problem):
```
"""
    cmds = extract_commands(sample, "sample.md")
    assert [c.args for c in cmds] == [
        ("sync=gloo_bucketd", "experiment=quick"),
        ("algo.num_stepz=5",),
        ("placement=split_schema",),
        ("sync=gloo_bucketed",),
    ]
    found = [problem(c) for c in cmds]
    assert all(found), found
    assert "gloo_bucketd" in found[0] and "num_stepz" in found[1] and "split_schema" in found[2]
    assert "documented as refused" in found[3]
    # ... and the same lines, fixed, pass.
    assert problem(Command("fixed", ("sync=gloo_bucketed", "experiment=quick"))) is None
    assert (
        problem(Command("fixed", ("sync=nccl_bucketed", "data=long8k"), "error: invalid configuration (1 problem):"))
        is None
    )


def test_extraction_handles_continuations_sweeps_and_placeholders():
    text = (
        "```bash\n.venv/bin/python run.py data=files \\\n    eval.every_n_steps=5   # a comment\n```\n"
        'See `python run.py -m sweep=<name> algo=grpo,rloo --cfg hydra` and `make run ARGS="algo.num_steps=5"`.'
    )
    cmds = extract_commands(text, "t.md")
    assert [c.args for c in cmds] == [
        ("data=files", "eval.every_n_steps=5"),
        ("-m", "sweep=<name>", "algo=grpo,rloo", "--cfg", "hydra"),
        ("algo.num_steps=5",),
    ]
    jobs = job_overrides(cmds[1].args)
    assert len(jobs) == 2 * len(config_help.options("sweep")) and ["sweep=kl_coef", "algo=rloo"] in jobs


# ----------------------------------------------------------------------------- config groups table
def readme_table() -> dict[str, list[str]]:
    """README's "Config groups" table: group -> the options named in its `options` column."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Config groups", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (m := re.fullmatch(r"`(\w+)`", cells[0])):
            table[m[1]] = re.findall(r"`([\w.-]+)`", cells[1])
    return table


def test_readme_config_groups_table_matches_conf():
    table = readme_table()
    conf = {g: config_help.options(g) for g in config_help.groups()}
    assert sorted(table) == sorted(conf), "groups: README table vs conf/"
    for group, options in conf.items():
        assert sorted(table[group]) == sorted(options), f"README's `{group}` row vs conf/{group}/"


def test_stale_table_row_is_caught():
    text = "## Config groups\n\n| group | options | what |\n|---|---|---|\n| `sync` | `gloo_bucketed`, `gloo_bucketd` | x |\n"
    import tests.test_docs as me

    real = me.REPO
    fake = Path(__import__("tempfile").mkdtemp())
    (fake / "README.md").write_text(text)
    try:
        me.REPO = fake
        table = readme_table()
    finally:
        me.REPO = real
    assert set(table["sync"]) - set(config_help.options("sync")) == {"gloo_bucketd"}


# ----------------------------------------------------------------------------- --help
def test_every_option_has_a_one_line_description():
    missing, long = [], []
    for group in config_help.groups():
        for option in config_help.options(group):
            text = config_help.description(group, option)
            if not text:
                missing.append(f"conf/{group}/{option}.yaml")
    assert not missing, f"options without a header comment (their --help description): {missing}"
    for line in config_help.groups_text().splitlines():
        if line.endswith("..."):
            long.append(line)
    assert not long, f"descriptions cut to fit {config_help.WIDTH} columns: {long}"


def test_help_lists_only_real_options_with_descriptions_and_examples():
    proc = subprocess.run(
        [sys.executable, "run.py", "--help", "algo=grpo"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "schema" not in out.replace("(conf/<group>/<option>.yaml)", "")
    lines = out.splitlines()
    # One screen: every group's options (12 groups since `env`; ~75 options since model=smollm2_student)
    # fit 100 lines.
    assert max(len(line) for line in lines) <= config_help.WIDTH and len(lines) <= 100, (len(lines), out)
    listed = re.sub(r"\{([\w,]+)\}_(\w+)", lambda m: " ".join(f"{h}_{m[2]}" for h in m[1].split(",")), out)
    for group in config_help.groups():
        for option in config_help.options(group):
            assert re.search(rf"\s{option}\s", listed), (group, option)
    assert re.search(r"\* grpo\s+GRPO", out) and re.search(
        r"\* gloo_bucketed\s+Flat buckets", out
    )  # in use, overrides applied
    assert not re.search(r"\* ppo\b", out)
    assert out.count("python run.py ") >= 4  # usage + three examples


def test_schemas_are_not_options():
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for override in (
            "placement=split_schema",
            "placement=split_schema".replace("_schema", "") + "x",
            "sync=bucketed",
        ):
            with pytest.raises(ConfigCompositionException):
                compose(config_name="config", overrides=[override])
        from hydra.core.config_store import ConfigStore

        stored = ConfigStore.instance().repo
        assert "schema" in stored and "placement" not in stored  # schemas live under schema/ only


def test_config_yaml_defaults_list_is_commented():
    listed = config_help.defaults_list()
    assert [g for g, _ in listed] == [g for g in config_help.groups() if g in dict(listed)]
    assert set(dict(listed)) == set(config_help.groups())
    assert all(what for _, what in listed), listed


# ----------------------------------------------------------------------------- exit codes
# Each exit code README documents -> tests (module::function) that produce it from `python run.py`.
EXIT_CODE_TESTS = {
    0: [
        "tests.config.test_config_errors::test_cli_dry_run_prints_split_plan",
        "tests.e2e.test_resume::test_sigkill_then_sigint_then_resume_gives_the_uninterrupted_run_bit_for_bit",
    ],
    2: [
        "tests.config.test_config_errors::test_cli_nccl_on_cpu_exits_2_fast_with_message",
        "tests.config.test_config_errors::test_a_launcher_refusing_its_value_exits_2",
    ],
    3: [
        "tests.e2e.test_own_data_and_reward::test_reward_returning_nan_stops_the_run_naming_function_and_sample",
        "tests.config.test_config_errors::test_unexpected_failure_exits_3_with_one_line",
    ],
    130: [
        "tests.config.test_config_errors::test_sigint_during_start_up_exits_130",
        "tests.e2e.test_resume::test_sigkill_then_sigint_then_resume_gives_the_uninterrupted_run_bit_for_bit",
    ],
    143: ["tests.e2e.test_resume::test_sigterm_during_start_up_stops_before_the_first_step_with_exit_143"],
}


def readme_exit_codes() -> set[int]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    para = next(p for p in text.split("\n\n") if p.lstrip().startswith("Exit codes:"))
    return {int(c) for c in re.findall(r"`(\d+)`", para)}


def test_every_documented_exit_code_has_a_test_that_produces_it():
    documented = readme_exit_codes()
    assert documented == set(EXIT_CODE_TESTS), (documented, sorted(EXIT_CODE_TESTS))
    for code, tests in EXIT_CODE_TESTS.items():
        for ref in tests:
            module, name = ref.split("::")
            source = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
            fn = getattr(importlib.import_module(module), name, None)
            assert callable(fn), f"exit {code}: {ref} does not exist"
            body = source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
            assert re.search(rf"(returncode|rc|code) == {code}\b", body), f"{ref} does not assert exit {code}"


# ----------------------------------------------------------------------------- links and paths
# Paths of other repositories that a reference page names (docs/reproductions.md: TinyZero's script).
OTHER_REPOSITORIES = {"scripts/train_tiny_zero.sh"}


def relative_links(text: str) -> list[str]:
    """The targets of a page's Markdown links and images that point into the checkout (no scheme,
    no bare anchor), anchors cut off."""
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", t)]


def named_paths(text: str) -> set[str]:
    """The tests and scripts of this checkout a page names (`tests/...`, `scripts/...`)."""
    found = re.findall(r"(?<![\w./-])((?:tests|scripts)/[\w./-]*\w)", text)
    return {p for p in found if "<" not in p and "*" not in p} - OTHER_REPOSITORIES


def test_every_relative_link_resolves():
    broken = [
        f"{p.relative_to(REPO)}: {t}"
        for p in DOCS
        for t in relative_links(p.read_text(encoding="utf-8"))
        if not (p.parent / t).exists()
    ]
    assert broken == []


def test_every_test_and_script_a_reference_page_names_exists():
    # Reference pages only: docs/measurements/ records runs as they were, with the paths of the day.
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [
        f"{p.relative_to(REPO)}: {t}"
        for p in pages
        for t in sorted(named_paths(p.read_text(encoding="utf-8")))
        if not (REPO / t).exists()
    ]
    assert missing == []


def test_the_link_and_path_checks_see_what_they_check():
    text = "![plot](img/a.png) [x](#anchor) [y](https://e.org) [z](../testing.md#tiers) `tests/sync/test_buckets.py::t`"
    assert relative_links(text) == ["img/a.png", "../testing.md"]
    assert named_paths(text + " scripts/train_tiny_zero.sh tests/<package>/") == {"tests/sync/test_buckets.py"}
