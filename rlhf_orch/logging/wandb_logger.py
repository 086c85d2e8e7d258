"""Console line plus Weights & Biases; offline (files under the run dir) without an API key."""

from __future__ import annotations

import os
from typing import Any, Optional

from rlhf_orch.logging.console import ConsoleLogger


class WandbLogger(ConsoleLogger):
    def __init__(self, project: str = "rlhf_orch", mode: Optional[str] = None, entity: Optional[str] = None):
        super().__init__()
        self.project = project
        self.mode = mode
        self.entity = entity
        self.run = None

    def start(self, run_dir: str, config: dict[str, Any], name: str) -> None:
        super().start(run_dir, config, name)
        import wandb

        mode = self.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=self.project, entity=self.entity, name=name, dir=run_dir, mode=mode, config=config, reinit="finish_previous"
        )
        self.console.print(f"wandb: mode={mode}, files under {run_dir}/wandb")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        super().log(step, metrics)
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
