"""<run dir>/run.log holds the driver's console output (rlhf_orch.logging.runlog), plain, with the
progress bar of a terminal left out of it and intact on the terminal."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from rlhf_orch.logging import runlog
from rlhf_orch.logging.console import ConsoleLogger

REPO = Path(__file__).resolve().parents[2]
METRICS = {"reward/mean": 0.5, "kl": 0.01, "time/step": 1.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tee_writes_console_output_to_run_log_and_restores_the_streams(tmp_path, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with runlog.tee_console(tmp_path / "run.log"):
        print("hello")
        print("\x1b[1mbold\x1b[0m")
        print("error: boom", file=sys.stderr)
        runlog.log_only("only in the log")
    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue() == "hello\n\x1b[1mbold\x1b[0m\n" and err.getvalue() == "error: boom\n"
    assert (tmp_path / "run.log").read_text() == "hello\nbold\nerror: boom\nonly in the log\n"


def test_progress_bar_stays_on_the_terminal_and_run_log_gets_the_step_lines(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setenv("TERM", "xterm")
    with runlog.tee_console(tmp_path / "run.log"):
        logger = ConsoleLogger()
        logger.start(str(tmp_path), {"algo": {"num_steps": 2}}, "t")
        assert logger.interactive and logger._direct
        logger.log(1, {"step": 1, **METRICS})
        print("checkpoint: step 1 -> somewhere")  # printed while the bar is live: above it
        logger.log(2, {"step": 2, **METRICS})
        logger.close()
    shown = term.getvalue()
    assert "training" in shown and "checkpoint: step 1" in shown  # the bar and the print, on the terminal
    log = (tmp_path / "run.log").read_text()
    assert "\x1b" not in log and "training" not in log  # no bar frames
    lines = log.splitlines()
    assert lines[0] == f"rlhf_orch run 't' -> {tmp_path}"
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step    1/2", "step    2/2"]
    assert lines.count("checkpoint: step 1 -> somewhere") == 1


def test_a_dry_run_writes_run_log(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "run.py", "launcher.dry_run=true", "placement=split", f"hydra.run.dir={run}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (run / "run.log").read_text() == proc.stdout + proc.stderr
