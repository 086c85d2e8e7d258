"""The hostile corpus (tests/env/sandbox_corpus.py, 29 programs) in every mode this machine gives: as
root (a separate uid, namespaces), with the audit hook off (the OS boundaries alone) and on; and as
a non-root uid (`setpriv` to 65534: a user and a pid namespace of the code's own), hook off. Each
program must end bounded or refused, leak nothing and leave no process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlhf_orch.env.sandbox import sandbox_support
from tests.env import sandbox_corpus

REPO = str(Path(__file__).resolve().parents[2])
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _failures(results: dict[str, str | None]) -> dict[str, str]:
    assert len(results) == len(sandbox_corpus.CORPUS) >= 20
    return {name: problem for name, problem in results.items() if problem}


@pytest.mark.parametrize(
    "audit_hook", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["os_only", "audit_hook"]
)
def test_the_hostile_corpus_is_contained_as_root(audit_hook):
    if os.geteuid() != 0:
        pytest.skip("this mode needs root (the non-root mode is the test below)")
    if sandbox_support().missing:
        pytest.skip(f"not every boundary works on this host: {sandbox_support().describe()}")
    token, planted = sandbox_corpus.plant(REPO)
    try:
        results = sandbox_corpus.run_corpus(REPO, token, planted, audit_hook=audit_hook)
    finally:
        sandbox_corpus.remove(planted)
    assert _failures(results) == {}


def _interpreter_for_nobody() -> str | None:
    """A Python >= 3.10 uid 65534 can run, and start again as itself (what the sandbox does): ours
    may live where that uid cannot reach (/root, mode 0700)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/python{version}", "/usr/bin/python3"):
        if not os.path.exists(candidate):
            continue
        probe = subprocess.run(
            [
                *NOBODY,
                candidate,
                "-c",
                "import subprocess, sys; subprocess.run([sys.executable, '-I', '-c', 'import json'], check=True, "
                "capture_output=True); print(sys.version_info >= (3, 10))",
            ],
            capture_output=True,
            text=True,
            cwd="/",
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


# What uid 65534 runs, copied out of the checkout (which may sit where that uid cannot go: a clone in
# a 0700 temp or home directory): the corpus and the sandbox modules it imports (standard library
# besides; the sandbox's bootstrap, sandbox_child.py, is run from beside sandbox.py).
_STAGED = (
    "tests/env/sandbox_corpus.py",
    "rlhf_orch/__init__.py",
    "rlhf_orch/env/__init__.py",
    "rlhf_orch/env/sandbox.py",
    "rlhf_orch/env/sandbox_child.py",
    "rlhf_orch/env/sandbox_view.py",
)


def _searchable_by_all(path: str) -> bool:
    """Every directory from / to `path` lets others through (o+x)."""
    parts = Path(path).resolve().parts
    return all(os.stat(os.path.join(*parts[: i + 1])).st_mode & 0o001 for i in range(len(parts)))


def _stage_for_nobody() -> str:
    """A directory uid 65534 can read holding `_STAGED`, laid out as in the checkout (the corpus at its
    top): for the sandbox it is the checkout (it hides it as it hides this one)."""
    base = tempfile.gettempdir()
    stage = tempfile.mkdtemp(prefix="rlhf_orch_corpus_checkout_", dir=base if _searchable_by_all(base) else "/tmp")
    for relative in _STAGED:
        target = Path(stage) / (Path(relative).name if relative.startswith("tests/") else relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(REPO) / relative, target)
    for directory, _, files in os.walk(stage):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return stage


def test_the_hostile_corpus_is_contained_as_a_non_root_uid():
    """The engine as uid 65534 (a Slurm or Kubernetes job): the sandbox gets its boundaries from a
    user namespace; the same corpus, the same checks, run by that uid from a copy it can read (the
    checkout may be in a directory it cannot enter); the secret planted in that copy."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start a process as another uid")
    python = _interpreter_for_nobody()
    if python is None:
        pytest.skip("no Python >= 3.10 that uid 65534 can run")
    stage = _stage_for_nobody()
    try:
        token, planted = sandbox_corpus.plant(stage)
        try:
            request = json.dumps({"repo": stage, "token": token, "planted": planted, "audit_hook": False})
            run = subprocess.run(
                [*NOBODY, python, os.path.join(stage, "sandbox_corpus.py")],
                input=request,
                capture_output=True,
                text=True,
                cwd="/",
                timeout=600,
            )
        finally:
            sandbox_corpus.remove(planted)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert (report["uid"], report["gid"]) == (65534, 65534)
    assert _failures(report["results"]) == {}
