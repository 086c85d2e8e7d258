"""Logger interface and the metrics.jsonl writer every run has."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsFile:
    """Appends one JSON object per step to <run_dir>/metrics.jsonl, flushed every line.

    Flushing per line means a crash or a kill loses at most the step in progress.
    """

    def __init__(self, run_dir: str | Path, keep_through_step: int | None = None):
        """`keep_through_step` (resume): records of later steps -- written after the checkpoint the
        run resumes from -- are dropped first, so every step appears once, from the run that counts."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= keep_through_step]
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


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:  # a line cut by a kill mid-write
        return math.inf


class StepLogger:
    """What the `logger` group builds: receives each step's metrics and the run's config.

    `run_id` (when the backend has one) is kept in checkpoints; `start(resume_id=...)` continues it.
    """

    run_id: str | None = None

    def start(self, run_dir: str, config: dict[str, Any], name: str, resume_id: str | None = None) -> None:
        self.run_dir = run_dir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, exit_code: int = 0, preempted: bool = False) -> None:
        """`exit_code` != 0: the run failed or was stopped; `preempted`: by a signal."""
