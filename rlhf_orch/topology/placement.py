"""The `_target_` classes of `conf/placement/*`: config fields in, a `PlacementPlan` out.

Each class takes exactly the fields of its schema dataclass (`rlhf_orch.config.schema`) as keyword
arguments, which is how `hydra.utils.instantiate(cfg.placement)` builds it, and its `plan()` calls its
own planner function. Every field is required here: the schema is the single home of the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf_orch.topology.plan import PlacementPlan, plan_colocated, plan_cpu_local, plan_split


@dataclass(frozen=True, kw_only=True)
class CpuLocalPlacement:
    """Every process on this machine's CPUs (no GPUs), one CPU bundle each."""

    actor_ranks: int
    critic_ranks: int
    reference_ranks: int
    engines: int
    engine_tp: int
    reward: str
    nodes: int
    gpus_per_node: int

    def plan(self) -> PlacementPlan:
        return plan_cpu_local(
            actor_ranks=self.actor_ranks,
            critic_ranks=self.critic_ranks,
            reference_ranks=self.reference_ranks,
            engines=self.engines,
            engine_tp=self.engine_tp,
            reward=self.reward,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
        )


@dataclass(frozen=True, kw_only=True)
class ColocatedPlacement:
    """Every role shares every GPU, each claiming its fraction of the GPUs it sits on."""

    actor_ranks: int
    critic_ranks: int
    reference_ranks: int
    engines: int
    engine_tp: int
    reward: str
    nodes: int
    gpus_per_node: int
    actor_fraction: float
    critic_fraction: float
    reference_fraction: float
    engine_fraction: float

    def plan(self) -> PlacementPlan:
        return plan_colocated(
            actor_ranks=self.actor_ranks,
            critic_ranks=self.critic_ranks,
            reference_ranks=self.reference_ranks,
            engines=self.engines,
            engine_tp=self.engine_tp,
            reward=self.reward,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            actor_fraction=self.actor_fraction,
            critic_fraction=self.critic_fraction,
            reference_fraction=self.reference_fraction,
            engine_fraction=self.engine_fraction,
        )


@dataclass(frozen=True, kw_only=True)
class SplitPlacement:
    """Trainer GPUs and vLLM GPUs disjoint.

    The inherited `actor_ranks`, `critic_ranks`, `reference_ranks` and `engines` fields are accepted
    but not used: in this layout they follow from the GPU counts (one rank per actor/critic GPU, one
    reference beside each actor rank, one engine per `engine_tp` vLLM GPUs). Read them from the plan.
    """

    actor_ranks: int
    critic_ranks: int
    reference_ranks: int
    engines: int
    engine_tp: int
    reward: str
    nodes: int
    gpus_per_node: int
    ratio: Optional[str]
    actor_gpus: int
    critic_gpus: int
    vllm_gpus: int
    reference_fraction: float

    def plan(self) -> PlacementPlan:
        return plan_split(
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            engine_tp=self.engine_tp,
            reward=self.reward,
            ratio=self.ratio,
            actor_gpus=self.actor_gpus,
            critic_gpus=self.critic_gpus,
            vllm_gpus=self.vllm_gpus,
            reference_fraction=self.reference_fraction,
        )
