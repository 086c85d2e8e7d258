"""Checks of values and derived quantities, run on the driver before Ray or any actor starts.

Each check is a small function returning the problems it found; every problem names the config
key, the value it has, and the fix. `validate` runs them all and raises one `ConfigError`
listing every problem, so a user fixes everything in one go.

The valid range of every single key is one row of `RANGES` (rlhf_orch.config.ranges). Checks
between keys (sums, divisibility, one key against another) are the functions in `CHECKS`, each in
the module of its concern: `checks_shapes` (lengths, batch shapes, data, model), `checks_placement`
(placement, hardware, launcher), `checks_run` (sync, pipeline, timeouts), `checks_algo` (algorithm,
reward, evaluation), `checks_env` (multi-turn rollouts). Some of these are also refused by the
constructors or the planner (which stop at the first problem); they are repeated here so that
`validate` reports everything at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from rlhf_orch.checkpoint_dirs import OWN_RUN_DIR
from rlhf_orch.config.checks_algo import algorithm, evaluation, reward, teacher
from rlhf_orch.config.checks_env import TRAJECTORY_ENVS, env
from rlhf_orch.config.checks_placement import (
    engine_memory,
    gpus,
    launcher,
    lora,
    offload,
    placement,
    reference_memory,
    roles,
)
from rlhf_orch.config.checks_run import pipeline, sync_backend, timeouts
from rlhf_orch.config.checks_shapes import batch_sizes, data, lengths, model_source, transfer
from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import ConfigError, Problem
from rlhf_orch.config.ranges import lookup, range_problems
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.topology.plan import PlacementPlan

# (importable from here as before)
__all__ = [
    "CHECKS",
    "ConfigError",
    "Hardware",
    "Problem",
    "TRAJECTORY_ENVS",
    "check_run_dir_writable",
    "range_problems",
    "validate",
]


def _ranges(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    return range_problems(cfg)


def _paths(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    resume = lookup(cfg, "resume")
    if isinstance(resume, str) and resume not in ("auto", OWN_RUN_DIR) and not Path(resume).expanduser().exists():
        problems.append(
            Problem(
                "resume",
                resume,
                "no such run or checkpoint directory; give an existing one, "
                f"'auto' (the latest checkpoint of this experiment_name), '{OWN_RUN_DIR}' (this run's own "
                "hydra.run.dir, if it has a checkpoint) or null",
            )
        )
    ckpt = lookup(cfg, "checkpoint.dir")
    if (
        isinstance(ckpt, str)
        and ckpt.strip()
        and Path(ckpt).expanduser().exists()
        and not Path(ckpt).expanduser().is_dir()
    ):
        problems.append(
            Problem(
                "checkpoint.dir",
                ckpt,
                "is a file, not a directory; give a directory shared by every node (or null for <run dir>/checkpoints)",
            )
        )
    return problems


CHECKS: tuple[Callable[[RootConfig, PlacementPlan, Hardware], list[Problem]], ...] = (
    _ranges,
    batch_sizes,
    gpus,
    lengths,
    sync_backend,
    engine_memory,
    algorithm,
    teacher,
    roles,
    model_source,
    transfer,
    pipeline,
    env,
    evaluation,
    placement,
    data,
    reward,
    timeouts,
    launcher,
    _paths,
    offload,
    reference_memory,
    lora,
)


def validate(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> None:
    problems = [p for check in CHECKS for p in check(cfg, plan, hw)]
    if problems:
        raise ConfigError(problems)


# =========================================================================== the run directory
def check_run_dir_writable(path: Path) -> None:
    """Refuse a run dir that cannot be created, or in which a small file cannot be written and deleted."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rlhf_orch_write_check_", dir=path)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)  # a full disk may only say so here
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            [
                Problem(
                    "hydra.run.dir",
                    str(path),
                    f"cannot write there ({reason}); give a writable directory, e.g. hydra.run.dir=/tmp/rlhf_orch/run",
                )
            ]
        ) from e
