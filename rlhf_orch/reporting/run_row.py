"""One run as every report shows it (`RunRow`), and how a set of them is counted.

The sweep summary (`sweep_summary`) reads rows from run dirs and writes the table; its plot
(`sweep_plot`) draws them: both take the row from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

# The step-time breakdown of the table: time/<phase> medians (rlhf_orch.orchestration.loop).
PHASES = ("generate", "transfer", "experience", "train", "sync")
STATUSES = ("completed", "interrupted", "aborted", "failed", "dry_run")


@dataclass
class RunRow:
    """One run (or sweep job) as the summary shows it."""

    run_dir: Path
    job: str  # the job number in its sweep, or the run's position on compare_runs' command line
    overrides: list[str]
    status: str  # completed | interrupted | aborted | failed (| dry_run: launcher.dry_run=true, nothing trained)
    reason: str = ""  # why it is not completed ("" when it is)
    steps: int = 0
    reward_first: Optional[float] = None
    reward_last: Optional[float] = None
    eval_last: Optional[float] = None
    eval_metric: str = ""
    step_s: Optional[float] = None  # median time/step over the timed steps
    phases_s: dict[str, Optional[float]] = field(default_factory=dict)  # median time/<phase>
    timed_steps: int = 0  # steps the medians are over (0: only warm-up steps were there, medians over those)
    wall_s: Optional[float] = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, reward/mean)
    stack_s: dict[str, float] = field(default_factory=dict)  # the step-time stack the plot draws (medians)
    label: str = ""  # what tells this run apart from the others (set by `label_rows`)

    def csv_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "job": self.job,
            "label": self.label,
            "status": self.status,
            "reason": self.reason,
            "steps": self.steps,
            "reward_first": _fmt(self.reward_first),
            "reward_last": _fmt(self.reward_last),
            "eval_last": _fmt(self.eval_last),
            "eval_metric": self.eval_metric,
            "step_s_median": _fmt(self.step_s),
            "timed_steps": self.timed_steps,
            "wall_s": _fmt(self.wall_s),
            "overrides": " ".join(self.overrides),
            "run_dir": str(self.run_dir),
        }
        rec.update({f"{p}_s_median": _fmt(self.phases_s.get(p)) for p in PHASES})
        return rec


def _fmt(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.6g}"


def tally(rows: Sequence[RunRow]) -> str:
    counts = [(s, sum(r.status == s for r in rows)) for s in STATUSES]
    parts = ", ".join(f"{n} {s}" for s, n in counts if n)
    return f"{len(rows)} {'run' if len(rows) == 1 else 'runs'}: {parts}" if rows else "no runs"
