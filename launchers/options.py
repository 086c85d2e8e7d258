"""The `launcher` group's declarations: how Ray is reached (`launchers.local`, `launchers.cluster`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class LauncherConfig:
    _target_: str = MISSING
    dry_run: bool = False  # print the placement plan and the memory plan, and exit without starting actors
    # A run whose memory plan does not fit: "refuse" (exit 2, before Ray starts) or "warn" (say so, run).
    memory_check: str = "refuse"
    # Fraction of each device (GPU, host) the memory plan keeps free for what it does not model:
    # a trainer on an H100 held up to 1.4 % more than planned (allocator reserve with expandable
    # segments, scripts/bench_memory.py --gpu); vLLM on a GPU and NCCL are stated, not measured.
    memory_margin: float = 0.05
    # Ray logical GPUs to declare when the machine has none (CPU testing of GPU layouts).
    logical_gpus: int = 0
    num_cpus: Optional[int] = None
    address: Optional[str] = None
    startup_timeout_s: float = 600.0
    # true: run inside the Ray session this process already has (a notebook, the test suite, runs
    # started one after another from a script) and leave it up for the next; false: the run owns its
    # Ray connection (local: starts Ray) and ends it. Either way the run removes its actors.
    reuse_session: bool = False
    # true (needs reuse_session=true): a run that completes with every actor answering leaves its
    # engines and trainer processes up, and the next run of this process on the same placement plan
    # resets and uses them instead of starting new ones (~12 CPU-s an engine, ~7 a trainer rank
    # saved; rlhf_orch.orchestration.warm_actors). Their resources stay claimed between runs.
    keep_actors: bool = False


@dataclass
class LocalLauncherConfig(LauncherConfig):
    _target_: str = "launchers.local.LocalRayLauncher"


@dataclass
class ClusterLauncherConfig(LauncherConfig):
    _target_: str = "launchers.cluster.ClusterRayLauncher"
    address: Optional[str] = "auto"
