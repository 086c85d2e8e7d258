"""The hostile corpus (tests/sandbox_corpus.py, 27 programs) in every mode this machine gives: as
root (a separate uid, namespaces), with the audit hook off (the OS boundaries alone) and on; and as
a non-root uid (`setpriv` to 65534: a user and a pid namespace of the code's own), hook off. Each
program must end bounded or refused, leak nothing and leave no process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_orch.env.sandbox import sandbox_support
from tests import sandbox_corpus

REPO = str(Path(__file__).resolve().parents[1])
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _failures(results: dict[str, str | None]) -> dict[str, str]:
    assert len(results) == len(sandbox_corpus.CORPUS) >= 20
    return {name: problem for name, problem in results.items() if problem}


@pytest.mark.parametrize("audit_hook", [False, True], ids=["os_only", "audit_hook"])
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
        probe = subprocess.run([*NOBODY, candidate, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-I', '-c', 'import json'], check=True, "
                                "capture_output=True); print(sys.version_info >= (3, 10))"],
                               capture_output=True, text=True, cwd="/")
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


def test_the_hostile_corpus_is_contained_as_a_non_root_uid():
    """The engine as uid 65534 (a Slurm or Kubernetes job): the sandbox gets its boundaries from a
    user namespace; the same corpus, the same checks, run by that uid."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start a process as another uid")
    python = _interpreter_for_nobody()
    if python is None:
        pytest.skip("no Python >= 3.10 that uid 65534 can run")
    token, planted = sandbox_corpus.plant(REPO)
    try:
        request = json.dumps({"repo": REPO, "token": token, "planted": planted, "audit_hook": False})
        run = subprocess.run([*NOBODY, python, str(Path(__file__).with_name("sandbox_corpus.py"))], input=request,
                             capture_output=True, text=True, cwd="/", timeout=600)
    finally:
        sandbox_corpus.remove(planted)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["uid"] == 65534
    assert _failures(report["results"]) == {}
