"""The `placement` group's declarations: where every role runs (`rlhf_orch.topology.placement`
builds each option from these fields; `rlhf_orch.topology.plan` plans it).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class PlacementConfig:
    """Where every role runs: the fields every layout has."""

    _target_: str = MISSING
    engine_tp: int = 1  # tensor-parallel size of one engine (GPUs per engine)
    nodes: int = 1
    gpus_per_node: int = 0
    # Reference ranks inside the policy ranks' processes (one process less per policy rank):
    # null = wherever the plan allows (a reference rank per policy rank, on its node and GPU),
    # true = required, false = a process per reference rank.
    reference_in_actor: Optional[bool] = None


@dataclass
class RankedPlacementConfig(PlacementConfig):
    """Layouts whose rank and engine counts are set directly (split derives them from GPU counts)."""

    actor_ranks: int = 1  # DeepSpeed data-parallel ranks of the policy
    critic_ranks: int = 1  # DeepSpeed data-parallel ranks of the value model
    reference_ranks: int = 1  # forward-only ranks: the initial policy (KL term), the teacher (algo.distill_coef)
    engines: int = 1  # vLLM engines


@dataclass
class CpuLocalPlacementConfig(RankedPlacementConfig):
    _target_: str = "rlhf_orch.topology.placement.CpuLocalPlacement"


@dataclass
class ColocatedPlacementConfig(RankedPlacementConfig):
    """Every role shares every GPU; each role takes a fraction of each GPU."""

    _target_: str = "rlhf_orch.topology.placement.ColocatedPlacement"
    gpus_per_node: int = 8
    # Fractions of one GPU each role's process claims on a shared bundle (sum must be <= 1).
    actor_fraction: float = 0.25
    critic_fraction: float = 0.25
    reference_fraction: float = 0.15
    engine_fraction: float = 0.35
    gpu_memory_gb: Optional[float] = (
        None  # one GPU as sold: 80 for an 80GB A100/H100; null = this machine's GPU (the memory plan)
    )
    # one node's RAM as sold (GiB; null = this machine's where it has CUDA GPUs, else not planned): what
    # offloaded optimizer states and sleeping engines' weights take on the host (the memory plan)
    host_memory_gb: Optional[float] = None


@dataclass
class SplitPlacementConfig(PlacementConfig):
    """Trainer GPUs and vLLM GPUs are disjoint.

    Either give `ratio` ("trainer:vllm", e.g. "1:1") and let the planner split all GPUs, or give the
    per-role GPU counts. Reference ranks share the actor's GPUs (fractional), the reward model
    (if any) shares the critic's.
    """

    _target_: str = "rlhf_orch.topology.placement.SplitPlacement"
    gpus_per_node: int = 8
    ratio: Optional[str] = None
    actor_gpus: int = 4
    critic_gpus: int = 2
    vllm_gpus: int = 2
    reference_fraction: float = 0.25
    gpu_memory_gb: Optional[float] = (
        None  # one GPU as sold: 80 for an 80GB A100/H100; null = this machine's GPU (the memory plan)
    )
    # one node's RAM as sold (GiB; null = this machine's where it has CUDA GPUs, else not planned): what
    # offloaded optimizer states and sleeping engines' weights take on the host (the memory plan)
    host_memory_gb: Optional[float] = None
    # Derived from the GPU counts (a policy rank per actor GPU with a reference beside it, a critic
    # rank per critic GPU, an engine per engine_tp vLLM GPUs); a value is refused, naming the key to set.
    actor_ranks: Optional[int] = None
    critic_ranks: Optional[int] = None
    reference_ranks: Optional[int] = None
    engines: Optional[int] = None
