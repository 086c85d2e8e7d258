"""The number a sweep optimises, and what run.py's Hydra function returns (or exits with).

`objective(summary)`: the run's score from its summary.json -- the last evaluation's score
(`eval/<source>/mean@k`, averaged over the sources) when the run evaluated, else `reward_last`
(the mean of the last few steps' `reward/mean`). Higher is better. None when the run did not
complete: a sweeper must not rank a stopped or failed run.

`job_result(run)` wraps `rlhf_orch.app.main` for `@hydra.main`:

- a single run exits with the app's code when it is not 0 (as before) and returns the objective;
- a multirun job never ends the sweep on a failure: a failed job (exit 2 or 3, or an exception)
  returns None -- Hydra's basic sweeper ignores the value, the Optuna sweeper marks the trial
  failed and goes on -- and its reason is in the job dir's error.log, for the sweep summary (the
  app's traceback, or the exit code with the `error: ...` message the app printed);
- a job stopped by SIGINT/SIGTERM (exit 128 + signal, after its checkpoint) stops the sweep too:
  the summary of the jobs so far is written into the sweep dir, then the process exits with it.

Hydra's `run_job` catches only `Exception` (not `SystemExit`), so an `exit` inside a multirun job
ends the whole sweep before the jobs after it and before `on_multirun_end` (the summary).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from rlhf_orch.logging.base import finite_or_none
from rlhf_orch.reporting.scores import eval_score

# What app.main's exit codes mean (rlhf_orch.app: EXIT_CONFIG, EXIT_RUNTIME, EXIT_SIGNAL_BASE).
EXIT_MEANING = {2: "configuration error, nothing started", 3: "runtime failure"}
SIGNAL_BASE = 128


def objective(summary: Optional[Mapping[str, Any]]) -> Optional[float]:
    """The score to maximise: eval score when the run evaluated, else reward_last; None unless completed."""
    if not summary or summary.get("status") != "completed":
        return None
    score = eval_score(summary.get("eval_last"))
    if score is not None:
        return score[0]
    return finite_or_none(summary.get("reward_last"))


def objective_source(summary: Optional[Mapping[str, Any]]) -> str:
    """Which number `objective` took: the eval metric's name or "reward_last"."""
    score = eval_score((summary or {}).get("eval_last"))
    return score[1] if score else "reward_last"


# --------------------------------------------------------------------------- run.py
def _hydra() -> Any:
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get()
    except ValueError:  # not under @hydra.main (a test calling the function directly)
        return None


def in_multirun() -> bool:
    from hydra.types import RunMode

    hc = _hydra()
    return hc is not None and hc.mode == RunMode.MULTIRUN


def _note_failure(job_dir: Path, reason: str) -> None:
    """error.log in the job dir (kept if the app already wrote one: its traceback is better)."""
    path = job_dir / "error.log"
    if not path.exists():
        job_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(reason.rstrip("\n") + "\n", encoding="utf-8")


class _ErrorLines:
    """sys.stderr, passed through, remembering the last `error: ...` message the app printed (a
    configuration error leaves nothing else behind: the sweep summary takes its reason from it)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.last_error: Optional[str] = None

    def write(self, text: str) -> int:
        if text.startswith("error: "):
            self.last_error = text[len("error: ") :].rstrip("\n")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def job_result(run: Callable[[], tuple[int, Optional[Mapping[str, Any]]]]) -> Optional[float]:
    """Run `run()` -> (exit code, summary or None) as run.py's Hydra task; see the module docstring."""
    if not in_multirun():
        code, summary = run()
        if code:
            sys.exit(code)
        return objective(summary)

    hc = _hydra()
    job_dir = Path(hc.runtime.output_dir)
    stderr = _ErrorLines(sys.stderr)
    try:
        with contextlib.redirect_stderr(stderr):
            code, summary = run()
    except Exception as e:  # an unforeseen failure: this job's row says so, the other jobs still run
        text = traceback.format_exc()
        print(text, file=sys.stderr, end="")
        _note_failure(job_dir, text)
        print(f"job {hc.job.num} failed ({type(e).__name__}); the sweep goes on", file=sys.stderr, flush=True)
        return None
    if code >= SIGNAL_BASE:
        from rlhf_orch.reporting.sweep_summary import write_sweep_summary

        print(
            f"job {hc.job.num} was stopped by a signal (exit {code}): the sweep stops here", file=sys.stderr, flush=True
        )
        try:
            written = write_sweep_summary(Path(hc.sweep.dir))
            print(f"sweep summary so far: {written['md']}", file=sys.stderr, flush=True)
        except Exception as e:  # the exit code matters more than the summary
            print(f"could not write the sweep summary: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(code)
    if code:
        meaning = EXIT_MEANING.get(code, "failed")
        _note_failure(job_dir, f"exit {code}: {meaning}\n{stderr.last_error or '(no message)'}")
        print(f"job {hc.job.num} failed (exit {code}: {meaning}); the sweep goes on", file=sys.stderr, flush=True)
        return None
    value = objective(summary)
    if value is not None:
        print(f"job {hc.job.num} objective ({objective_source(summary)}): {value:.6g}", flush=True)
    else:  # a dry run, or a run without a finished step: nothing to rank (Optuna marks the trial failed)
        print(f"job {hc.job.num}: no score (the run trained no step)", flush=True)
    return value
