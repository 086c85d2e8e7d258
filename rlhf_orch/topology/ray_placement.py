"""Realise a `PlacementPlan` as Ray placement groups: one STRICT_PACK group per planned node.

STRICT_PACK keeps a planned node's bundles on one real node. On its own it would let two planned
nodes share one big real node, so each group after the first carries a `ray.io/node-id` label
selector excluding the real nodes already taken: planned nodes map one-to-one to distinct real nodes
(assigned greedily in plan order).

    with RayPlacement(plan, ready_timeout_s=60) as placement:
        actor = PolicyActor.options(**placement.options_for(plan.slots_for("actor")[0])).remote()
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Optional

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_orch.topology.plan import PlacementPlan, RoleSlot

NODE_ID_LABEL = "ray.io/node-id"


class PlacementUnavailableError(RuntimeError):
    """Ray could not place a planned node; the message says what was asked and what Ray has."""


class RayPlacement:
    """Placement groups for one plan. Create with `create()` or by entering the context manager."""

    def __init__(
        self,
        plan: PlacementPlan,
        *,
        ready_timeout_s: float = 120.0,
        name_prefix: str = "rlhf_orch",
    ) -> None:
        self.plan = plan
        self.ready_timeout_s = ready_timeout_s
        self.name_prefix = name_prefix
        self._groups: list[PlacementGroup] = []
        self._real_node_ids: list[str] = []

    # ---- lifecycle
    def create(self) -> "RayPlacement":
        """Create and wait for every planned node's group (idempotent)."""
        if self._groups:
            return self
        self._fail_fast_if_no_node_fits()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            for planned_node, bundles in enumerate(self.plan.nodes):
                group = placement_group(
                    [dict(bundle) for bundle in bundles],
                    strategy="STRICT_PACK",
                    name=f"{self.name_prefix}-{self.plan.layout}-node{planned_node}",
                    bundle_label_selector=self._selector_excluding_taken_nodes(len(bundles)),
                )
                self._groups.append(group)
                self._wait_ready(planned_node, group, deadline)
                self._real_node_ids.append(_node_of(group))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove every group created so far (their actors are killed by Ray)."""
        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception:  # Ray may already be gone at interpreter exit
                pass
        self._groups = []
        self._real_node_ids = []

    def __enter__(self) -> "RayPlacement":
        return self.create()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.remove()

    # ---- lookups
    @property
    def placement_groups(self) -> tuple[PlacementGroup, ...]:
        return tuple(self._groups)

    @property
    def real_node_ids(self) -> tuple[str, ...]:
        """Hex Ray node id each planned node landed on (index = planned node)."""
        return tuple(self._real_node_ids)

    def placement_group_for(self, slot: RoleSlot) -> PlacementGroup:
        if not self._groups:
            raise RuntimeError("RayPlacement.create() (or `with RayPlacement(...)`) must run before lookups")
        return self._groups[slot.node]

    def options_for(self, slot: RoleSlot) -> dict[str, Any]:
        """Keyword arguments for `SomeActor.options(**...)` that pin the actor to its slot."""
        return {
            "num_cpus": slot.num_cpus,
            "num_gpus": slot.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group_for(slot),
                placement_group_bundle_index=slot.bundles[0],
                # Tasks/actors the slot's process starts (e.g. vLLM TP workers) stay in the group.
                placement_group_capture_child_tasks=True,
            ),
        }

    # ---- internals
    def _selector_excluding_taken_nodes(self, num_bundles: int) -> Optional[list[dict[str, str]]]:
        if not self._real_node_ids:
            return None
        excluded = ",".join(self._real_node_ids)
        return [{NODE_ID_LABEL: f"!in({excluded})"} for _ in range(num_bundles)]

    def _wait_ready(self, planned_node: int, group: PlacementGroup, deadline: float) -> None:
        remaining = max(deadline - time.monotonic(), 0.0)
        ready, _ = ray.wait([group.ready()], timeout=remaining)
        if not ready:
            raise PlacementUnavailableError(
                f"planned node {planned_node} of the {self.plan.layout} plan was not placed within "
                f"{self.ready_timeout_s:g} s.\n{self._shortfall_report(planned_node)}"
            )

    def _fail_fast_if_no_node_fits(self) -> None:
        """Refuse at once when a planned node exceeds every alive node's total resources."""
        alive = _alive_node_resources()
        for planned_node, bundles in enumerate(self.plan.nodes):
            need = _summed(bundles)
            if not any(_fits(need, have) for have in alive.values()):
                raise PlacementUnavailableError(
                    f"planned node {planned_node} of the {self.plan.layout} plan needs {_fmt_resources(need)} "
                    f"on one node, more than any alive Ray node has.\n{self._shortfall_report(planned_node)}"
                )
        if len(self.plan.nodes) > len(alive):
            raise PlacementUnavailableError(
                f"the {self.plan.layout} plan has {len(self.plan.nodes)} planned nodes but Ray has "
                f"{len(alive)} alive node(s); each planned node needs its own real node.\n"
                f"{self._shortfall_report(len(alive))}"
            )

    def _shortfall_report(self, planned_node: int) -> str:
        asked = self.plan.nodes[min(planned_node, len(self.plan.nodes) - 1)]
        where = "STRICT_PACK on one node"
        if self._real_node_ids:
            where += f" not used by planned nodes 0..{len(self._real_node_ids) - 1}"
        lines = [
            f"asked: {len(asked)} bundles {list(asked)} ({where})",
            f"ray.cluster_resources(): {_fmt_resources(ray.cluster_resources())}",
            f"ray.available_resources(): {_fmt_resources(ray.available_resources())}",
            "alive nodes (totals):",
        ]
        for node_id, resources in _alive_node_resources().items():
            taken = ""
            if node_id in self._real_node_ids:
                taken = f" (holds planned node {self._real_node_ids.index(node_id)})"
            lines.append(f"  {node_id[:12]}: {_fmt_resources(resources)}{taken}")
        lines.append("fix: lower the placement's GPUs/ranks/nodes, or give Ray more resources or nodes")
        return "\n".join(lines)


def _node_of(group: PlacementGroup) -> str:
    return next(iter(placement_group_table(group)["bundles_to_node_id"].values()))


def _alive_node_resources() -> dict[str, dict[str, float]]:
    return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}


def _summed(bundles: tuple[dict, ...]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(key, 0.0) + 1e-9 >= amount for key, amount in need.items())


def _fmt_resources(resources: dict[str, float]) -> str:
    # Only the schedulable kinds people reason about (Ray also lists memory and node: markers), and
    # always both: Ray leaves out a kind whose availability dropped to 0, which is the telling case.
    return "{" + ", ".join(f"{kind}: {resources.get(kind, 0.0):g}" for kind in ("CPU", "GPU")) + "}"
