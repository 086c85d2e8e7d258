"""Placement plans: which process of which role runs on which planned node and bundle.

Pure data and arithmetic, no Ray: a plan can be built, printed (dry run) and tested anywhere.
`rlhf_orch.topology.ray_placement` turns a plan into Ray placement groups, one per planned node.

Vocabulary
  * planned node: a group of bundles that must land on one real machine (node 0 is filled first).
  * bundle: the resources of one GPU (plus the CPUs of the processes on it) in GPU layouts, or the
    CPUs of one process in the CPU layout.
  * slot: one process of one role. It claims `num_gpus` on its first bundle; an engine with
    `engine_tp > 1` owns `engine_tp` bundles of one node and its other tensor-parallel workers claim
    the same share on the remaining bundles.

The plans' data types live here; each layout's planner in `planners.py` (every planner raises
`PlacementError` naming the config key, its value and how to fix it), the reference hosted in the
policy's processes in `reference_hosting.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROLES: tuple[str, ...] = ("actor", "critic", "reference", "reward", "engine")


class PlacementError(ValueError):
    """A placement config that cannot be planned; the message names the key and the fix."""


# --------------------------------------------------------------------------- data structures
@dataclass(frozen=True)
class RoleSlot:
    """One process of one role, pinned to bundle(s) of one planned node."""

    role: str
    rank: int
    node: int
    bundles: tuple[int, ...]
    num_gpus: float
    num_cpus: float

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; roles are {', '.join(ROLES)}")
        if not self.bundles:
            raise ValueError(f"{self.role} rank {self.rank} has no bundle")


@dataclass(frozen=True)
class BundleClaim:
    """One process's claim on one bundle (engines' extra TP workers included)."""

    role: str
    rank: int
    tp_rank: int
    num_gpus: float

    @property
    def label(self) -> str:
        worker = f"/tp{self.tp_rank}" if self.tp_rank else ""
        return f"{self.role}{self.rank}{worker}"


@dataclass(frozen=True)
class PlacementPlan:
    """The whole layout: per planned node its bundles, and every process's slot."""

    layout: str
    nodes: tuple[tuple[dict, ...], ...]
    slots: tuple[RoleSlot, ...]
    engine_tp: int
    # The reference ranks run inside the policy ranks' processes (rank r in policy rank r's):
    # their slots stay in the plan (the same device, the same memory terms but the runtime's),
    # no process of their own starts (`with_reference_hosting`, placement.reference_in_actor).
    reference_in_actor: bool = False

    def __post_init__(self) -> None:
        # A slot pointing outside its node's bundle list would only fail later inside Ray.
        for slot in self.slots:
            if not 0 <= slot.node < len(self.nodes):
                raise ValueError(f"{slot.role} rank {slot.rank} is on unknown node {slot.node}")
            for bundle in slot.bundles:
                if not 0 <= bundle < len(self.nodes[slot.node]):
                    raise ValueError(
                        f"{slot.role} rank {slot.rank} uses bundle {bundle} but node {slot.node} "
                        f"has {len(self.nodes[slot.node])} bundles"
                    )

    # ---- queries
    @property
    def roles(self) -> tuple[str, ...]:
        """Roles present in this plan, in canonical order."""
        present = {slot.role for slot in self.slots}
        return tuple(role for role in ROLES if role in present)

    def slots_for(self, role: str) -> list[RoleSlot]:
        return sorted((slot for slot in self.slots if slot.role == role), key=lambda s: s.rank)

    def num_ranks(self, role: str) -> int:
        return len(self.slots_for(role))

    @property
    def total_gpus(self) -> int:
        """Whole GPUs reserved by all bundles of all planned nodes."""
        return int(round(sum(bundle.get("GPU", 0) for node in self.nodes for bundle in node)))

    @property
    def total_cpus(self) -> float:
        return float(sum(bundle.get("CPU", 0) for node in self.nodes for bundle in node))

    def gpus_per_role(self) -> dict[str, float]:
        """GPU amount each role claims; an engine counts its share once per TP bundle."""
        totals = {role: 0.0 for role in self.roles}
        for slot in self.slots:
            totals[slot.role] += slot.num_gpus * len(slot.bundles)
        return {role: round(amount, 6) for role, amount in totals.items()}

    def claims_on(self, node: int, bundle: int) -> list[BundleClaim]:
        """Every process claiming the given bundle, in slot order."""
        claims = []
        for slot in self.slots:
            if slot.node == node and bundle in slot.bundles:
                tp_rank = slot.bundles.index(bundle)
                claims.append(BundleClaim(slot.role, slot.rank, tp_rank, slot.num_gpus))
        return claims

    def shares_gpu(self, role: str) -> bool:
        """Whether a process of `role` shares a GPU with another process of the run (every role of
        a colocated layout; trainer roles on fractions of one GPU): the memory plan then counts the
        GPU by phase, each process's phase terms in their phase only. A reference hosted in the
        policy's processes (`reference_in_actor`) is no process of its own: theirs is asked."""
        if self.reference_in_actor and role == "reference":
            return self.shares_gpu("actor")
        for slot in self.slots_for(role):
            for bundle in slot.bundles:
                others = {
                    (c.role, c.rank)
                    for c in self.claims_on(slot.node, bundle)
                    if not (self.reference_in_actor and c.role == "reference")
                } - {(slot.role, slot.rank)}
                if self.nodes[slot.node][bundle].get("GPU") and others:
                    return True
        return False

    # ---- rendering
    def describe(self) -> str:
        """A plain-text table of slots and node bundles (printed by the dry run)."""
        gpu_layout = self.total_gpus > 0
        lines = [
            f"placement: {self.layout}  planned nodes={len(self.nodes)}  GPUs={self.total_gpus}  "
            f"CPUs={format_amount(self.total_cpus)}  engine_tp={self.engine_tp}",
            "",
        ]
        slot_rows = [("role", "rank", "node", "bundles", "GPU", "CPU")]
        for role in self.roles:
            for slot in self.slots_for(role):
                share = format_amount(slot.num_gpus)
                if len(slot.bundles) > 1:
                    share = f"{share} x{len(slot.bundles)}"
                slot_rows.append(
                    (
                        role,
                        str(slot.rank),
                        str(slot.node),
                        ",".join(str(b) for b in slot.bundles),
                        share,
                        format_amount(slot.num_cpus),
                    )
                )
        lines += text_table(slot_rows)
        if self.reference_in_actor:
            lines.append("reference ranks run inside the actor ranks' processes (placement.reference_in_actor)")
        lines.append("")
        bundle_rows = [("node", "bundle", "resources", "claimed GPU", "processes")]
        for node_index, bundles in enumerate(self.nodes):
            for bundle_index, resources in enumerate(bundles):
                claims = self.claims_on(node_index, bundle_index)
                claimed = sum(claim.num_gpus for claim in claims)
                bundle_rows.append(
                    (
                        str(node_index),
                        str(bundle_index),
                        " ".join(f"{key}={format_amount(value)}" for key, value in sorted(resources.items())),
                        format_amount(claimed) if gpu_layout else "-",
                        " ".join(
                            (f"{claim.label}({format_amount(claim.num_gpus)})" if gpu_layout else claim.label)
                            + (
                                f"[in actor{claim.rank}]"
                                if self.reference_in_actor and claim.role == "reference"
                                else ""
                            )
                            for claim in claims
                        ),
                    )
                )
        lines += text_table(bundle_rows)
        if gpu_layout:
            lines.append("")
            per_role = "  ".join(f"{role}={format_amount(gpus)}" for role, gpus in self.gpus_per_role().items())
            lines.append(f"GPUs per role: {per_role}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def format_amount(value: float) -> str:
    """A count or GPU share as the plan's tables print it (1, 0.25, 0.3333)."""
    return f"{value:g}" if float(value).is_integer() else f"{value:.4g}"


def text_table(rows: list[tuple[str, ...]] | list[list[str]], right_from: int | None = None) -> list[str]:
    """`rows` (the first the header) as aligned text lines, a rule under the header; the columns from
    index `right_from` on (numbers) right-aligned."""
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    rendered = [
        "  ".join(
            cell.rjust(width) if right_from is not None and col >= right_from else cell.ljust(width)
            for col, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    rendered.insert(1, "  ".join("-" * width for width in widths))
    return rendered


# --------------------------------------------------------------------------- CUDA IPC feeds
@dataclass(frozen=True)
class IpcFeed:
    """Which policy rank hands weights to one tensor-parallel worker of one engine.

    CUDA IPC maps another process's memory of the *same* GPU only: the worker on (node, bundle)
    must be fed by the policy rank on that very GPU. `policy_rank` is None when no policy rank sits
    there (such a layout cannot use CUDA IPC; validation refuses it).
    """

    engine: int
    tp_rank: int
    node: int
    bundle: int
    policy_rank: Optional[int]


def ipc_feeds(plan: PlacementPlan) -> list[IpcFeed]:
    """Every engine worker (engine order, then TP rank) with the policy rank sharing its GPU."""
    policy_at = {(slot.node, slot.bundles[0]): slot.rank for slot in plan.slots_for("actor")}
    return [
        IpcFeed(slot.rank, tp_rank, slot.node, bundle, policy_at.get((slot.node, bundle)))
        for slot in plan.slots_for("engine")
        for tp_rank, bundle in enumerate(slot.bundles)
    ]


def unfed_ipc_workers(feeds: list[IpcFeed]) -> list[IpcFeed]:
    return [feed for feed in feeds if feed.policy_rank is None]


def feed_table(feeds: list[IpcFeed]) -> dict[tuple[int, int], int]:
    """(engine, tp_rank) -> policy rank; raises PlacementError if a worker has no policy rank on its GPU."""
    missing = unfed_ipc_workers(feeds)
    if missing:
        where = ", ".join(f"engine{f.engine}/tp{f.tp_rank} on node {f.node} GPU {f.bundle}" for f in missing)
        raise PlacementError(
            f"sync=cuda_ipc needs a policy rank on every engine GPU; none on: {where}. Raise "
            "placement.actor_ranks to cover every engine GPU, or use sync=nccl_bucketed"
        )
    return {(f.engine, f.tp_rank): f.policy_rank for f in feeds}


def describe_feeds(feeds: list[IpcFeed]) -> str:
    """The dry run's table: which policy rank feeds which engine worker over CUDA IPC."""
    rows = [("engine", "tp rank", "node", "GPU", "fed by")]
    for f in feeds:
        fed = "NONE (no policy rank on this GPU)" if f.policy_rank is None else f"policy rank {f.policy_rank}"
        rows.append((str(f.engine), str(f.tp_rank), str(f.node), str(f.bundle), fed))
    senders = sorted({f.policy_rank for f in feeds if f.policy_rank is not None})
    head = f"CUDA IPC feeds: {len(feeds)} engine worker(s), sending policy ranks {senders}"
    return "\n".join([head, *text_table(rows)])
