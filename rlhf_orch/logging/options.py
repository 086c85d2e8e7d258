"""The `logger` group's declarations (`rlhf_orch.logging.console`, `.wandb_logger`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class LoggerConfig:
    _target_: str = MISSING
    plot_every_n_steps: int = 0  # refresh <run dir>/plots every n steps (0 = only when the run ends)
    verbose: bool = False  # Ray/vLLM/DeepSpeed output on the console too (otherwise only in the run dir)
    # What the model wrote: <run dir>/rollouts/step_<N>.jsonl, the whole sequence decoded (special
    # tokens kept), prompt, response, reward, advantage, turns, data source, truncation, env errors,
    # and per token: text, loss mask, advantage, engine/trainer log-probs, weight version
    # (rlhf_orch.logging.rollout_dump; the run page, rlhf_orch.view, shows them).
    rollouts: bool = True
    rollouts_per_step: int = 16  # sequences written per step (the lowest indices: whole prompt groups)
    # Write the dump on every n-th step only (steps n, 2n, ...): a long run's dump stays a sample of it.
    rollouts_every_n_steps: int = 1
    # The run page (python -m rlhf_orch.view): <run dir>/report.html written when the run ends and
    # every plot_every_n_steps steps (curves and the dumped trajectories, one self-contained file).
    report: bool = False


@dataclass
class ConsoleLoggerConfig(LoggerConfig):
    _target_: str = "rlhf_orch.logging.console.ConsoleLogger"


@dataclass
class WandbLoggerConfig(LoggerConfig):
    _target_: str = "rlhf_orch.logging.wandb_logger.WandbLogger"
    project: str = "rlhf_orch"
    mode: Optional[str] = None  # None: "online" if WANDB_API_KEY is set, else "offline"
    entity: Optional[str] = None
