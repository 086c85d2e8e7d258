"""Logger interface and the metrics.jsonl writer every run has."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite_or_none(value: Any) -> float | None:
    """A metric's value as a float when it is a finite real number (bools are not), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class MetricsFile:
    """Appends one JSON object per step to <run_dir>/metrics.jsonl, flushed every line.

    Flushing per line means a crash or a kill loses at most the step in progress.
    """

    def __init__(self, run_dir: str | Path, keep_through_step: int | None = None):
        """`keep_through_step` (resume, a restart): records of later steps -- written after the
        checkpoint the run goes back to, and about to be run again -- stay, marked
        `"superseded": true` (what happened is never erased); `read_metrics` leaves them out, so
        every step counts once, from the run that counts. A line cut by a kill mid-write is dropped."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through_step is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8").splitlines():
                record = _record(line)
                if record is None:
                    continue
                if record.get("step", 0) > keep_through_step and not record.get(SUPERSEDED):
                    line = json.dumps({**record, SUPERSEDED: True}, sort_keys=True)
                kept.append(line)
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(self.path)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


# The key marking a record of a step that was run again after it (a restart or a resume went back
# to an earlier checkpoint): kept as a record of what happened, not part of the run's curve.
SUPERSEDED = "superseded"


def read_metrics(run_dir: str | Path, include_superseded: bool = False) -> list[dict[str, Any]]:
    """The records of <run_dir>/metrics.jsonl, in order (none when it is missing); a line cut by a
    kill is skipped; records of steps run again later only with `include_superseded`."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [_record(line) for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    return [r for r in rows if r is not None and (include_superseded or not r.get(SUPERSEDED))]


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:  # a line cut by a kill mid-write (or an empty one)
        return None
    return record if isinstance(record, dict) else None


EXIT_OK = 0  # `close(exit_code)` of a run that completed


class StepLogger:
    """What the `logger` group builds: receives each step's metrics and the run's config.

    `run_id` (when the backend has one) is kept in checkpoints; `start(resume_id=...)` continues it.
    """

    run_id: str | None = None

    def start(self, run_dir: str, config: dict[str, Any], name: str, resume_id: str | None = None) -> None:
        self.run_dir = run_dir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, exit_code: int = EXIT_OK, preempted: bool = False) -> None:
        """`exit_code` != 0: the run failed or was stopped; `preempted`: by a signal."""
