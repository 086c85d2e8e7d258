"""The `_target_` classes of `conf/placement/*`: config fields in, a `PlacementPlan` out.

Each class takes exactly the fields of its schema dataclass (`rlhf_orch.config.schema`) as keyword
arguments, which is how `hydra.utils.instantiate(cfg.placement)` builds it, and its `plan()` hands
them to its own planner function. Every field is required here: the schema is the single home of
the defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, ClassVar, Optional

from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.topology.planners import plan_colocated, plan_cpu_local, plan_split
from rlhf_orch.topology.reference_hosting import with_reference_hosting

# Ray schedules actors by logical CPUs; on a 2-core box a run has more processes than cores, so a
# local run declares at least this many (they are bookkeeping, not pinned cores).
MIN_LOGICAL_CPUS = 16


@dataclass(frozen=True, kw_only=True)
class _Placement:
    """Fields every layout accepts (`PlacementConfig`)."""

    engine_tp: int
    nodes: int
    gpus_per_node: int
    reference_in_actor: Optional[bool] = None  # not the planner's: applied to its plan (`with_reference_hosting`)

    planner: ClassVar[Callable[..., PlacementPlan]]
    # Fields the layout derives instead of reading (not passed to the planner).
    derived: ClassVar[tuple[str, ...]] = ()

    def plan(self, reward_model: bool = False, critic: bool = True, reference: bool = True) -> PlacementPlan:
        """The layout; `reward_model`: the `reward` option has a reward-model role to place;
        `critic` / `reference`: the algorithm has a critic / a KL term (otherwise those roles get no
        ranks and no GPUs)."""
        kwargs = {k: v for k, v in asdict(self).items() if k not in self.derived and k != "reference_in_actor"}
        plan = type(self).planner(
            **kwargs, reward="model" if reward_model else "function", critic=critic, reference=reference
        )
        return with_reference_hosting(plan, self.reference_in_actor)


@dataclass(frozen=True, kw_only=True)
class _RankedPlacement(_Placement):
    """Layouts given rank and engine counts directly (`RankedPlacementConfig`)."""

    actor_ranks: int
    critic_ranks: int
    reference_ranks: int
    engines: int


@dataclass(frozen=True, kw_only=True)
class CpuLocalPlacement(_RankedPlacement):
    """Every process on this machine's CPUs (no GPUs), one CPU bundle each."""

    planner = staticmethod(plan_cpu_local)


@dataclass(frozen=True, kw_only=True)
class ColocatedPlacement(_RankedPlacement):
    """Every role shares every GPU, each claiming its fraction of the GPUs it sits on."""

    actor_fraction: float
    critic_fraction: float
    reference_fraction: float
    engine_fraction: float
    gpu_memory_gb: Optional[float] = None  # read by the memory plan (rlhf_orch.memory), not the planner
    host_memory_gb: Optional[float] = None  # read by the memory plan, not the planner

    planner = staticmethod(plan_colocated)
    derived = ("gpu_memory_gb", "host_memory_gb")


@dataclass(frozen=True, kw_only=True)
class SplitPlacement(_Placement):
    """Trainer GPUs and vLLM GPUs disjoint.

    Rank and engine counts are derived, not read: one rank per actor/critic GPU, one reference
    beside each actor rank, one engine per `engine_tp` vLLM GPUs. Read them from the plan.
    """

    ratio: Optional[str]
    actor_gpus: int
    critic_gpus: int
    vllm_gpus: int
    reference_fraction: float
    gpu_memory_gb: Optional[float] = None  # read by the memory plan (rlhf_orch.memory), not the planner
    host_memory_gb: Optional[float] = None  # read by the memory plan, not the planner
    # Always None (the config check refuses a value): the counts follow from the GPUs.
    actor_ranks: Optional[int] = None
    critic_ranks: Optional[int] = None
    reference_ranks: Optional[int] = None
    engines: Optional[int] = None

    planner = staticmethod(plan_split)
    derived = ("actor_ranks", "critic_ranks", "reference_ranks", "engines", "gpu_memory_gb", "host_memory_gb")

    def __post_init__(self) -> None:
        given = [f"placement.{k}={getattr(self, k)}" for k in self.derived[:4] if getattr(self, k) is not None]
        if given:
            raise ValueError(f"placement=split derives ranks and engines from the GPU counts: drop {', '.join(given)}")
