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

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class StepLogger:
    """What the `logger` group builds: receives each step's metrics and the run's config."""

    def start(self, run_dir: str, config: dict[str, Any], name: str) -> None:
        self.run_dir = run_dir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
