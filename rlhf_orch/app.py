"""What `python run.py` does with the composed config: check, plan, launch, train, report.

Exit codes: 0 done, 2 configuration error (nothing started), 3 runtime failure (an actor died,
a sync timed out). metrics.jsonl is flushed every step, so a failure loses no finished step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.config.validate import ConfigError, Hardware, validate
from rlhf_orch.reward.base import RewardError
from rlhf_orch.reward.scoring import build_reward
from rlhf_orch.topology.plan import PlacementError, PlacementPlan

EXIT_CONFIG = 2
EXIT_RUNTIME = 3


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check(cfg: DictConfig, launcher: Any) -> tuple[RootConfig, PlacementPlan]:
    """Typed config + plan, or ConfigError/PlacementError; runs before Ray starts."""
    typed: RootConfig = OmegaConf.to_object(cfg)
    reward = build_reward(cfg.reward)
    if reward.rule is not None:
        reward.rule.fn.check()  # a user's reward file is loaded here: its errors come before Ray
    plan = instantiate(cfg.placement).plan(
        reward_model=reward.has_model, critic=typed.algo.needs_critic, reference=typed.algo.needs_reference
    )
    hw = Hardware(gpus=launcher.gpus_present(), cuda=_cuda_available())
    if launcher.dry_run:
        # A dry run plans for the target cluster: GPUs missing *here* are reported, not fatal.
        hw = Hardware(gpus=max(hw.gpus, int(plan.total_gpus + 0.999)), cuda=hw.cuda or plan.total_gpus > 0)
    validate(typed, plan, hw)
    return typed, plan


def run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under @hydra.main (tests calling main() directly)
        return Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def main(cfg: DictConfig) -> int:
    launcher = instantiate(cfg.launcher)
    try:
        typed, plan = check(cfg, launcher)
    except (ConfigError, PlacementError, RewardError, ValueError) as e:
        # ValueError: a group option's constructor refused a value (it names the key).
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except InstantiationException as e:
        # A group option's constructor refused a value: its own message names the key.
        cause = e.__cause__ or e
        print(f"error: {cause}", file=sys.stderr)
        return EXIT_CONFIG
    except ConnectionError as e:
        # launcher=cluster asks the cluster how many GPUs it has before anything starts.
        print(f"error: cannot reach the Ray cluster at launcher.address={launcher.address!r}: {e}", file=sys.stderr)
        return EXIT_CONFIG

    if typed.launcher.dry_run:
        print(plan.describe())
        present = launcher.gpus_present()
        if plan.total_gpus > present:
            print(f"note: this machine offers {present} GPUs; the plan needs {plan.total_gpus:g} (dry run only)")
        return 0

    from rlhf_orch.orchestration.inputs import InputError
    from rlhf_orch.orchestration.session import run_training  # heavy imports only when training

    try:
        summary = run_training(cfg, typed, plan, launcher, run_dir())
    except InputError as e:  # the model, data or reward cannot be used: found before Ray started
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RuntimeError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    print(json.dumps(summary))
    return 0
