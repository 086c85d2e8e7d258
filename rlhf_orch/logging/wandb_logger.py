"""Console (progress bar or step lines, plots) plus Weights & Biases; offline (files under the run dir) without an API key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from rlhf_orch.logging.base import EXIT_OK
from rlhf_orch.logging.console import ConsoleLogger
from rlhf_orch.logging.options import WandbLoggerConfig


class WandbLogger(ConsoleLogger):
    def __init__(
        self,
        project: str = WandbLoggerConfig.project,
        mode: Optional[str] = None,
        entity: Optional[str] = None,
        plot_every_n_steps: int = WandbLoggerConfig.plot_every_n_steps,
        verbose: bool = False,
        rollouts: bool = True,
        rollouts_per_step: int = WandbLoggerConfig.rollouts_per_step,
        rollouts_every_n_steps: int = WandbLoggerConfig.rollouts_every_n_steps,
        report: bool = WandbLoggerConfig.report,
    ):
        super().__init__(
            plot_every_n_steps=plot_every_n_steps,
            verbose=verbose,
            rollouts=rollouts,
            rollouts_per_step=rollouts_per_step,
            rollouts_every_n_steps=rollouts_every_n_steps,
            report=report,
        )
        self.project = project
        self.mode = mode
        self.entity = entity
        self.run = None
        self._sync_dir = None
        self._logged_file: Optional[Path] = None
        self._logged_through = 0  # the W&B run has every step up to this one (a resumed run skips them)

    def start(self, run_dir: str, config: dict[str, Any], name: str, resume_id: str | None = None) -> None:
        super().start(run_dir, config, name, resume_id)
        import wandb

        mode = self.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=name,
            dir=run_dir,
            mode=mode,
            config=config,
            reinit="finish_previous",
            id=resume_id,  # a resumed run continues the same W&B run
            resume="allow" if resume_id else None,
            # Without logger.verbose, W&B keeps to its essential lines (no run history or summary tables).
            settings=wandb.Settings(quiet=not self.verbose),
        )
        self.run_id = self.run.id
        # Steps the W&B run already holds: those logged before the previous process stopped, which
        # can be later than the checkpoint this run resumes from (offline, W&B itself cannot say).
        self._logged_file = Path(run_dir) / "wandb" / LOGGED_STEPS_FILE
        self._logged_through = _logged_through(self._logged_file, self.run.id) if resume_id else 0
        self._sync_dir = getattr(self.run.settings, "sync_dir", None) if mode == "offline" else None
        self.console.print(
            f"wandb: mode={mode}, run {self.run.id}{' (resumed)' if resume_id else ''}, files under {run_dir}/wandb",
            markup=False,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        super().log(step, metrics)
        if step <= self._logged_through:  # re-run after a resume: the W&B run has this step already
            return
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        self._logged_through = step
        self._logged_file.write_text(json.dumps({"run_id": self.run.id, "step": step}))

    def close(self, exit_code: int = EXIT_OK, preempted: bool = False) -> None:
        super().close(exit_code, preempted)  # the progress bar ends and the plots are written first
        if self.run is not None:
            if preempted:
                self.run.mark_preempting()  # shown as preempted/crashed, never as finished
            self.run.finish(exit_code=exit_code)
            self.run = None
            if self._sync_dir:
                self.console.print(f"wandb: offline run; upload it with: wandb sync {self._sync_dir}", markup=False)


#: In <run dir>/wandb: the W&B run id and the last step logged to it.
LOGGED_STEPS_FILE = "rlhf_orch_logged_steps.json"


def _logged_through(path: Path, run_id: str) -> int:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    return int(record.get("step", 0)) if record.get("run_id") == run_id else 0
