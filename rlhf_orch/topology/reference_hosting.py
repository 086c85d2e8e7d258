"""Whether the reference ranks run inside the policy ranks' processes (`placement.reference_in_actor`):
what a plan allows (`reference_not_hostable`) and the plan with it decided (`with_reference_hosting`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from rlhf_orch.topology.plan import PlacementError, PlacementPlan


def reference_not_hostable(plan: PlacementPlan) -> str | None:
    """Why the plan's reference ranks cannot run inside the policy ranks' processes, or None when
    they can: one reference rank per policy rank, each on its policy rank's node and, on GPUs, on
    its bundle (the same GPU)."""
    references, actors = plan.slots_for("reference"), plan.slots_for("actor")
    if not references:
        return "the algorithm has no reference (no KL term or teacher)"
    if len(references) != len(actors):
        return f"{len(references)} reference ranks for {len(actors)} policy ranks (placement.reference_ranks must equal actor_ranks)"
    for ref, actor in zip(references, actors):
        if ref.node != actor.node or (plan.total_gpus > 0 and ref.bundles != actor.bundles):
            return f"reference rank {ref.rank} is planned on another node or GPU than policy rank {actor.rank}"
    return None


def with_reference_hosting(plan: PlacementPlan, reference_in_actor: Optional[bool]) -> PlacementPlan:
    """`plan` with its reference ranks inside the policy ranks' processes where asked and possible:
    `reference_in_actor` None (the default) hosts them when `reference_not_hostable` finds nothing
    against it, True requires it (PlacementError otherwise), False keeps a process per reference rank.

    What it saves: a process per policy rank (its start-up: torch, transformers and the model load,
    ~7 CPU-seconds and ~0.4 GB of host memory here; on a GPU its CUDA context), and the hand-over
    of each experience shard to a second process."""
    if reference_in_actor is not None and not plan.slots_for("reference"):
        raise PlacementError(
            f"placement.reference_in_actor={str(reference_in_actor).lower()} does nothing: the algorithm has no "
            "reference (no KL term or teacher), so no reference rank is placed: drop the key"
        )
    if reference_in_actor is False:
        return plan
    why_not = reference_not_hostable(plan)
    if why_not is None:
        return replace(plan, reference_in_actor=True)
    if reference_in_actor:
        raise PlacementError(
            f"placement.reference_in_actor=true but {why_not}: "
            "set placement.reference_in_actor=false (a process per reference rank) or null (decide by the plan)"
        )
    return plan
