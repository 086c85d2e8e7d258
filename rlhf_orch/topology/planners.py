"""Each layout's planner: `plan_cpu_local` (one CPU bundle per process), `plan_colocated` (every
role on every GPU) and `plan_split` (trainer and vLLM GPUs disjoint, `split_gpu_counts`), over the
checks of their arguments and the ledger of GPU claims they share.

Every planner raises `PlacementError` naming the config key, its value and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from rlhf_orch.topology.plan import BundleClaim, PlacementError, PlacementPlan, RoleSlot, format_amount

REWARD_KINDS: tuple[str, ...] = ("function", "model")

# Fractions are compared with this slack so that 0.25+0.25+0.15+0.35 counts as exactly 1.
_FRACTION_TOLERANCE = 1e-9


# --------------------------------------------------------------------------- argument checks
def _require_at_least(key: str, value: int, minimum: int, fix: str) -> None:
    if value < minimum:
        raise PlacementError(f"placement.{key}={value} must be >= {minimum}: {fix}")


def _require_fraction(key: str, value: float, *, allow_one: bool = True) -> None:
    upper_ok = value <= 1 if allow_one else value < 1
    if not (value > 0 and upper_ok):
        bound = "(0, 1]" if allow_one else "(0, 1)"
        raise PlacementError(f"placement.{key}={value} must be a GPU fraction in {bound}: set {key} to e.g. 0.25")


def _require_reward_kind(reward: str) -> None:
    if reward not in REWARD_KINDS:
        raise PlacementError(
            f"placement.reward={reward!r} is not one of {', '.join(map(repr, REWARD_KINDS))}: "
            "use 'function' for a rule-based reward or 'model' for a reward model"
        )


def _require_tp_fits_nodes(engine_tp: int, gpus_per_node: int) -> None:
    # An engine's TP workers talk over NVLink/PCIe inside one machine; a group straddling two
    # nodes would silently run tensor parallelism over the network.
    if gpus_per_node % engine_tp != 0:
        raise PlacementError(
            f"placement.gpus_per_node={gpus_per_node} is not a multiple of "
            f"placement.engine_tp={engine_tp}, so an engine's TP GPUs would straddle two nodes: "
            f"set engine_tp to a divisor of gpus_per_node"
        )


def _require_ranks_fit(key: str, ranks: int, capacity: int, nodes: int, gpus_per_node: int) -> None:
    if ranks > capacity:
        raise PlacementError(
            f"placement.{key}={ranks} needs more GPUs than the {capacity} of placement.nodes={nodes} x "
            f"placement.gpus_per_node={gpus_per_node}: set {key} <= {capacity} or add nodes/GPUs"
        )


# --------------------------------------------------------------------------- building plans
class _GpuLedger:
    """Global GPU indices (node-major: node 0's GPUs first) and the claims put on each."""

    def __init__(self, gpus_per_node: int, cpus_per_process: float) -> None:
        self.gpus_per_node = gpus_per_node
        self.cpus_per_process = cpus_per_process
        self.claims: dict[int, list[BundleClaim]] = {}
        self.slots: list[RoleSlot] = []

    def locate(self, gpu: int) -> tuple[int, int]:
        return divmod(gpu, self.gpus_per_node)

    def add(self, role: str, rank: int, gpus: list[int], share: float) -> None:
        node = self.locate(gpus[0])[0]
        if any(self.locate(gpu)[0] != node for gpu in gpus):
            # Callers align TP groups to node boundaries; this guards that invariant.
            raise AssertionError(f"{role} rank {rank} spans nodes: GPUs {gpus}")
        for tp_rank, gpu in enumerate(gpus):
            self.claims.setdefault(gpu, []).append(BundleClaim(role, rank, tp_rank, share))
        bundles = tuple(self.locate(gpu)[1] for gpu in gpus)
        self.slots.append(RoleSlot(role, rank, node, bundles, share, self.cpus_per_process))

    def check_fractions(self, fraction_names: dict[str, str]) -> None:
        for gpu in sorted(self.claims):
            claims = self.claims[gpu]
            total = sum(claim.num_gpus for claim in claims)
            if total > 1 + _FRACTION_TOLERANCE:
                node, bundle = self.locate(gpu)
                terms = " + ".join(
                    f"{claim.label}:{fraction_names[claim.role]}={format_amount(claim.num_gpus)}" for claim in claims
                )
                keys = sorted({fraction_names[claim.role] for claim in claims})
                raise PlacementError(
                    f"GPU fractions on node {node} bundle {bundle} sum to {total:.4g} > 1 ({terms}): "
                    f"lower placement.{', placement.'.join(keys)} so they sum to <= 1"
                )

    def build(self, layout: str, engine_tp: int) -> PlacementPlan:
        used = max(self.claims) + 1
        num_nodes = -(-used // self.gpus_per_node)
        nodes = []
        for node in range(num_nodes):
            first = node * self.gpus_per_node
            last = min(first + self.gpus_per_node, used)
            nodes.append(
                tuple(
                    # Each process on the GPU keeps its own CPU(s) inside the bundle.
                    {"CPU": len(self.claims.get(gpu, [])) * self.cpus_per_process, "GPU": 1}
                    for gpu in range(first, last)
                )
            )
        return PlacementPlan(layout, tuple(nodes), tuple(self.slots), engine_tp)


def plan_cpu_local(
    *,
    actor_ranks: int,
    critic_ranks: int,
    reference_ranks: int,
    engines: int,
    engine_tp: int,
    reward: str,
    nodes: int,
    gpus_per_node: int,
    cpus_per_process: float = 1.0,
    critic: bool = True,
    reference: bool = True,
) -> PlacementPlan:
    """Everything on node 0's CPUs: one CPU bundle per process, no GPUs.

    An engine with engine_tp=k gets k bundles (its TP workers are processes too); a reward model
    gets one bundle per critic rank (per actor rank without a critic). `critic=False` (a
    critic-free algorithm) places no critic at all, `reference=False` (no KL term, no teacher) no reference.
    """
    critic_ranks = critic_ranks if critic else 0
    reference_ranks = reference_ranks if reference else 0
    _check_ranks(actor_ranks, critic_ranks, reference_ranks, engines, engine_tp, critic, reference)
    _require_reward_kind(reward)
    if nodes != 1:
        raise PlacementError(
            f"placement.nodes={nodes} but placement=cpu_local runs everything on this machine: "
            "set nodes=1, or use placement=colocated/split for several nodes"
        )
    if gpus_per_node != 0:
        raise PlacementError(
            f"placement.gpus_per_node={gpus_per_node} but placement=cpu_local uses no GPUs: "
            "set gpus_per_node=0, or use placement=colocated/split to use GPUs"
        )
    _require_positive_cpus(cpus_per_process)

    bundles: list[dict] = []
    slots: list[RoleSlot] = []

    def add(role: str, rank: int, width: int) -> None:
        first = len(bundles)
        bundles.extend({"CPU": cpus_per_process} for _ in range(width))
        slots.append(RoleSlot(role, rank, 0, tuple(range(first, first + width)), 0.0, cpus_per_process))

    for role, ranks in (("actor", actor_ranks), ("critic", critic_ranks), ("reference", reference_ranks)):
        for rank in range(ranks):
            add(role, rank, 1)
    for rank in range(_reward_ranks(reward, critic_ranks or actor_ranks)):
        add("reward", rank, 1)
    for rank in range(engines):
        add("engine", rank, engine_tp)
    return PlacementPlan("cpu_local", (tuple(bundles),), tuple(slots), engine_tp)


def plan_colocated(
    *,
    actor_ranks: int,
    critic_ranks: int,
    reference_ranks: int,
    engines: int,
    engine_tp: int,
    reward: str,
    nodes: int,
    gpus_per_node: int,
    actor_fraction: float,
    critic_fraction: float,
    reference_fraction: float,
    engine_fraction: float,
    reward_fraction: Optional[float] = None,
    cpus_per_process: float = 1.0,
    critic: bool = True,
    reference: bool = True,
) -> PlacementPlan:
    """One bundle per GPU shared by every role; rank r of each role sits on global GPU r.

    Engine e owns GPUs [e*engine_tp, (e+1)*engine_tp) and claims engine_fraction on each. A reward
    model (reward="model") puts one rank on each critic rank's GPU (each actor rank's without a
    critic), claiming reward_fraction (default: reference_fraction, as it is a forward-only model
    like the reference). Without a critic (`critic=False`) or a reference (`reference=False`) their
    fractions are simply not claimed.
    """
    critic_ranks = critic_ranks if critic else 0
    reference_ranks = reference_ranks if reference else 0
    _check_ranks(actor_ranks, critic_ranks, reference_ranks, engines, engine_tp, critic, reference)
    _require_reward_kind(reward)
    _check_gpu_nodes(nodes, gpus_per_node)
    fractions = {
        "actor": ("actor_fraction", actor_fraction),
        "critic": ("critic_fraction", critic_fraction),
        "reference": ("reference_fraction", reference_fraction),
        "engine": ("engine_fraction", engine_fraction),
        "reward": _reward_fraction_key(reward_fraction, reference_fraction),
    }
    for key, value in fractions.values():
        _require_fraction(key, value)
    _require_positive_cpus(cpus_per_process)
    _require_tp_fits_nodes(engine_tp, gpus_per_node)

    capacity = nodes * gpus_per_node
    for key, ranks in (
        ("actor_ranks", actor_ranks),
        ("critic_ranks", critic_ranks),
        ("reference_ranks", reference_ranks),
    ):
        _require_ranks_fit(key, ranks, capacity, nodes, gpus_per_node)
    if engines * engine_tp > capacity:
        raise PlacementError(
            f"placement.engines={engines} x placement.engine_tp={engine_tp} = {engines * engine_tp} GPUs "
            f"exceed the {capacity} of placement.nodes={nodes} x placement.gpus_per_node={gpus_per_node}: "
            f"set engines <= {capacity // engine_tp} or add nodes/GPUs"
        )

    ledger = _GpuLedger(gpus_per_node, cpus_per_process)
    for role, ranks in (("actor", actor_ranks), ("critic", critic_ranks), ("reference", reference_ranks)):
        for rank in range(ranks):
            ledger.add(role, rank, [rank], fractions[role][1])
    for rank in range(_reward_ranks(reward, critic_ranks or actor_ranks)):
        ledger.add("reward", rank, [rank], fractions["reward"][1])
    for rank in range(engines):
        first = rank * engine_tp
        ledger.add("engine", rank, list(range(first, first + engine_tp)), engine_fraction)
    ledger.check_fractions({role: key for role, (key, _) in fractions.items()})
    return ledger.build("colocated", engine_tp)


@dataclass(frozen=True)
class SplitGpuCounts:
    """GPUs per role group in the split layout."""

    actor: int
    critic: int
    vllm: int


def split_gpu_counts(
    *,
    nodes: int,
    gpus_per_node: int,
    ratio: Optional[str],
    actor_gpus: int,
    critic_gpus: int,
    vllm_gpus: int,
    critic: bool = True,
) -> SplitGpuCounts:
    """Resolve the split layout's GPU counts from `ratio` or the explicit per-role counts.

    With ratio "T:V" all nodes*gpus_per_node GPUs are split T:V between trainer and vLLM; the trainer
    share is divided between actor and critic in proportion actor_gpus:critic_gpus (rounded, each
    keeps at least one GPU). Without a critic (`critic=False`): with `ratio` the whole trainer share
    goes to the actor; with explicit counts the critic's GPUs join the vLLM GPUs (critic-free
    algorithms sample several responses per prompt: generation is where the time goes).
    """
    capacity = nodes * gpus_per_node
    if not critic:
        counts = split_gpu_counts(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            ratio=ratio,
            actor_gpus=actor_gpus,
            critic_gpus=max(critic_gpus, 1),
            vllm_gpus=vllm_gpus,
        )
        if ratio is None:
            return SplitGpuCounts(counts.actor, 0, counts.vllm + critic_gpus)
        return SplitGpuCounts(counts.actor + counts.critic, 0, counts.vllm)
    if ratio is None:
        _require_at_least("actor_gpus", actor_gpus, 1, "the actor needs at least one GPU")
        _require_at_least("critic_gpus", critic_gpus, 1, "the critic needs at least one GPU")
        _require_at_least("vllm_gpus", vllm_gpus, 1, "vLLM needs at least one GPU")
        needed = actor_gpus + critic_gpus + vllm_gpus
        if needed > capacity:
            raise PlacementError(
                f"placement.actor_gpus={actor_gpus} + placement.critic_gpus={critic_gpus} + "
                f"placement.vllm_gpus={vllm_gpus} = {needed} GPUs exceed the {capacity} of "
                f"placement.nodes={nodes} x placement.gpus_per_node={gpus_per_node}: lower the per-role "
                "GPUs or raise nodes/gpus_per_node"
            )
        return SplitGpuCounts(actor_gpus, critic_gpus, vllm_gpus)

    trainer_part, vllm_part = _parse_ratio(ratio)
    share = Fraction(capacity * trainer_part, trainer_part + vllm_part)
    if share.denominator != 1:
        raise PlacementError(
            f"placement.ratio={ratio!r} cannot split the {capacity} GPUs of placement.nodes={nodes} x "
            f"placement.gpus_per_node={gpus_per_node} into whole GPUs: pick a ratio whose parts sum to a "
            f"divisor of {capacity}, or set ratio=null and give actor_gpus/critic_gpus/vllm_gpus"
        )
    trainer = int(share)
    vllm = capacity - trainer
    if trainer < 2:
        raise PlacementError(
            f"placement.ratio={ratio!r} leaves {trainer} trainer GPU(s) of {capacity}, but actor and critic "
            "need one GPU each: give the trainer a larger part of the ratio or add GPUs"
        )
    if vllm < 1:
        raise PlacementError(f"placement.ratio={ratio!r} leaves no GPU for vLLM: give vLLM a part of the ratio")
    _require_at_least("actor_gpus", actor_gpus, 1, "it sets the actor:critic proportion when ratio is set")
    _require_at_least("critic_gpus", critic_gpus, 1, "it sets the actor:critic proportion when ratio is set")
    actor = round(trainer * actor_gpus / (actor_gpus + critic_gpus))
    actor = min(max(actor, 1), trainer - 1)
    return SplitGpuCounts(actor, trainer - actor, vllm)


def plan_split(
    *,
    nodes: int,
    gpus_per_node: int,
    engine_tp: int,
    reward: str,
    ratio: Optional[str],
    actor_gpus: int,
    critic_gpus: int,
    vllm_gpus: int,
    reference_fraction: float,
    reward_fraction: Optional[float] = None,
    cpus_per_process: float = 1.0,
    critic: bool = True,
    reference: bool = True,
) -> PlacementPlan:
    """Trainer GPUs and vLLM GPUs disjoint; ranks and engines follow from the GPU counts.

    One actor rank per actor GPU (claiming 1 - reference_fraction) with one reference rank beside it
    (claiming reference_fraction); one critic rank per critic GPU (claiming 1 - reward_fraction when a
    reward model shares it); one engine per engine_tp vLLM GPUs. Engines take the first GPUs so that
    every TP group starts on a multiple of engine_tp and never straddles a node; then actor, then critic.
    Without a reference (`reference=False`) the actor keeps its whole GPU.
    """
    _require_at_least("engine_tp", engine_tp, 1, "an engine needs at least one GPU")
    _require_reward_kind(reward)
    _check_gpu_nodes(nodes, gpus_per_node)
    _require_fraction("reference_fraction", reference_fraction, allow_one=False)
    reward_key, reward_share = _reward_fraction_key(reward_fraction, reference_fraction)
    _require_fraction(reward_key, reward_share, allow_one=False)
    _require_positive_cpus(cpus_per_process)
    _require_tp_fits_nodes(engine_tp, gpus_per_node)

    counts = split_gpu_counts(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        ratio=ratio,
        actor_gpus=actor_gpus,
        critic_gpus=critic_gpus,
        vllm_gpus=vllm_gpus,
        critic=critic,
    )
    if counts.vllm % engine_tp != 0:
        if ratio is None:
            raise PlacementError(
                f"placement.vllm_gpus={counts.vllm} is not divisible by placement.engine_tp={engine_tp}: "
                "set vllm_gpus to a multiple of engine_tp"
            )
        raise PlacementError(
            f"placement.ratio={ratio!r} gives vLLM {counts.vllm} GPUs, not divisible by "
            f"placement.engine_tp={engine_tp}: change ratio or engine_tp so vLLM gets a multiple of engine_tp"
        )

    reward_model = reward == "model"
    critic_share = 1 - reward_share if reward_model else 1.0
    ledger = _GpuLedger(gpus_per_node, cpus_per_process)
    next_gpu = 0
    for rank in range(counts.vllm // engine_tp):
        ledger.add("engine", rank, list(range(next_gpu, next_gpu + engine_tp)), 1.0)
        next_gpu += engine_tp
    # Without a critic the reward model sits beside the actor ranks instead.
    reward_beside_actor = reward_model and counts.critic == 0
    reference_share = reference_fraction if reference else 0.0
    for rank in range(counts.actor):
        actor_share = 1 - reference_share - (reward_share if reward_beside_actor else 0.0)
        ledger.add("actor", rank, [next_gpu], actor_share)
        if reference:
            ledger.add("reference", rank, [next_gpu], reference_fraction)
        if reward_beside_actor:
            ledger.add("reward", rank, [next_gpu], reward_share)
        next_gpu += 1
    for rank in range(counts.critic):
        ledger.add("critic", rank, [next_gpu], critic_share)
        if reward_model:
            ledger.add("reward", rank, [next_gpu], reward_share)
        next_gpu += 1
    return ledger.build("split", engine_tp)


# --------------------------------------------------------------------------- shared helpers
def _check_ranks(
    actor_ranks: int,
    critic_ranks: int,
    reference_ranks: int,
    engines: int,
    engine_tp: int,
    critic: bool = True,
    reference: bool = True,
) -> None:
    _require_at_least("actor_ranks", actor_ranks, 1, "the policy needs at least one rank")
    if critic:
        _require_at_least("critic_ranks", critic_ranks, 1, "an algorithm with a critic needs at least one critic rank")
    if reference:
        _require_at_least("reference_ranks", reference_ranks, 1, "the KL term and the teacher need a reference rank")
    _require_at_least("engines", engines, 1, "rollouts need at least one vLLM engine")
    _require_at_least("engine_tp", engine_tp, 1, "an engine needs at least one device")


def _check_gpu_nodes(nodes: int, gpus_per_node: int) -> None:
    _require_at_least("nodes", nodes, 1, "plan at least one node")
    _require_at_least(
        "gpus_per_node", gpus_per_node, 1, "GPU layouts need GPUs; use placement=cpu_local on CPU machines"
    )


def _require_positive_cpus(cpus_per_process: float) -> None:
    if cpus_per_process <= 0:
        raise PlacementError(f"cpus_per_process={cpus_per_process} must be > 0: every process needs a CPU")


def _reward_ranks(reward: str, critic_ranks: int) -> int:
    # A reward model scores the same micro-batches the critic values: one rank per critic rank.
    return critic_ranks if reward == "model" else 0


def _reward_fraction_key(reward_fraction: Optional[float], reference_fraction: float) -> tuple[str, float]:
    if reward_fraction is None:
        return "reference_fraction", reference_fraction
    return "reward_fraction", reward_fraction


def _parse_ratio(ratio: str) -> tuple[int, int]:
    parts = str(ratio).split(":")
    try:
        trainer, vllm = (int(part.strip()) for part in parts)
    except ValueError:
        trainer = vllm = 0
    if len(parts) != 2 or trainer < 1 or vllm < 1:
        raise PlacementError(
            f"placement.ratio={ratio!r} is not 'trainer:vllm' with two positive integers: "
            "write it like '3:1', or set ratio=null and give actor_gpus/critic_gpus/vllm_gpus"
        )
    return trainer, vllm
