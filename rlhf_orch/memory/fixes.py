"""Fixes for a memory plan that does not fit: one pasteable override each, in the order that costs
the run least (ZeRO-3, a sharded or offloaded reference, optimizer offload, gradient checkpointing,
a smaller micro-batch, a smaller engine budget, wider engines, more GPUs). Every candidate is re-planned (and re-checked by the caller's `replan`);
only those that lower the worst device's need are offered, with what they leave it at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from rlhf_orch.algo.options import AlgoConfig, GRPOConfig
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.memory.plan import GB, MemoryPlan

#: Re-plans a modified config: the new memory plan, or None when the config is invalid.
Replan = Callable[[RootConfig], Optional[MemoryPlan]]


@dataclass(frozen=True)
class Fix:
    override: str  # what to paste after `python run.py`
    what: str  # what it costs the run
    config: RootConfig  # the config with it applied
    plan: MemoryPlan  # the plan of that config

    def describe(self) -> str:
        worst = self.plan.worst()
        if self.plan.fits:
            verdict = "fits"
        elif worst.headroom < 0:
            verdict = f"{worst.device.name} still short by {-worst.headroom / GB:.1f} GB"
        else:
            verdict = f"still refused: {'; '.join(self.plan.engine_problems)}"
        return f"{self.override}   # {self.what}; then {worst.device.name} needs {worst.need / GB:.1f} GB: {verdict}"


def _with(cfg: RootConfig, group: str, **changes) -> RootConfig:
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **changes)})


def _candidates(cfg: RootConfig, plan: MemoryPlan) -> Iterator[tuple[str, str, RootConfig]]:
    t, a, wl = cfg.trainer, cfg.algo, plan.workload
    trainer_dp = max((sum(1 for p in plan.processes if p.role == role) for role in ("actor", "critic")), default=1)
    if t.zero_stage < 3 and trainer_dp > 1:
        yield (
            "trainer.zero_stage=3",
            "weights and gradients sharded too (more communication)",
            _with(cfg, "trainer", zero_stage=3),
        )
    yield from _reference_candidates(cfg, plan, offload=False)
    if wl.on_gpu and not t.offload_optimizer:
        yield (
            "trainer.offload_optimizer=true",
            "optimizer states in host memory (slower optimizer steps)",
            _with(cfg, "trainer", offload_optimizer=True),
        )
    if not t.gradient_checkpointing:
        yield (
            "trainer.gradient_checkpointing=true",
            "activations recomputed in the backward (~30 % more trainer compute)",
            _with(cfg, "trainer", gradient_checkpointing=True),
        )
    yield from _reference_candidates(cfg, plan, offload=True)
    budget = getattr(cfg.transfer, "token_budget", 0)
    if budget and budget // 2 >= wl.max_seq_len:
        yield (
            f"transfer.token_budget={budget // 2}",
            "smaller packed micro-batches (more of them)",
            dataclasses.replace(cfg, transfer=dataclasses.replace(cfg.transfer, token_budget=budget // 2)),
        )
    elif a.micro_batch_size > 1:
        half = a.micro_batch_size // 2
        yield (
            f"algo.micro_batch_size={half}",
            "smaller micro-batches (more of them, same optimizer step)",
            _with(cfg, "algo", micro_batch_size=half),
        )
    yield from _engine_candidates(cfg, plan)
    yield from _engine_tp_candidates(cfg, plan)
    yield from _more_gpu_candidates(cfg, plan)
    yield from _algorithm_candidates(cfg, plan)


def _reference_candidates(cfg: RootConfig, plan: MemoryPlan, offload: bool) -> Iterator[tuple[str, str, RootConfig]]:
    """A whole KL reference per rank: shard it over the reference ranks (ZeRO-3: an all-gather per
    layer in the experience phase), or -- later, it costs more -- keep its shards in host memory
    (GPU layouts: every experience forward copies the model to the GPU again)."""
    references = sum(1 for p in plan.processes if p.role == "reference")
    now = cfg.trainer.reference_memory
    if not references or now == "offloaded":
        return
    if not offload and now == "full" and references > 1:
        yield (
            "trainer.reference_memory=sharded",
            "the reference sharded over its ranks by ZeRO-3 (an all-gather per layer in the experience phase)",
            _with(cfg, "trainer", reference_memory="sharded"),
        )
    if offload and plan.workload.on_gpu:
        yield (
            "trainer.reference_memory=offloaded",
            "the reference's shards in host memory (each experience forward copies them to the GPU)",
            _with(cfg, "trainer", reference_memory="offloaded"),
        )


def _algorithm_candidates(cfg: RootConfig, plan: MemoryPlan) -> Iterator[tuple[str, str, RootConfig]]:
    """Last, because it changes the experiment: an algorithm without a critic (GRPO's group baseline)."""
    if not cfg.algo.needs_critic:
        return
    common = {
        f.name: getattr(cfg.algo, f.name)
        for f in dataclasses.fields(AlgoConfig)
        if f.name not in ("_target_", "kl_placement", "kl_coef", "kl_estimator")
    }
    override, placement = "algo=grpo", cfg.placement
    if getattr(placement, "critic_ranks", None):
        placement = dataclasses.replace(placement, critic_ranks=0)
        override += " placement.critic_ranks=0"
    elif getattr(placement, "critic_gpus", None):
        placement = dataclasses.replace(placement, critic_gpus=0)
        override += " placement.critic_gpus=0"
    yield (
        override,
        "changes the algorithm: no critic (GRPO's group baseline instead of a value model)",
        dataclasses.replace(cfg, algo=GRPOConfig(**common), placement=placement),
    )


def _engine_candidates(cfg: RootConfig, plan: MemoryPlan) -> Iterator[tuple[str, str, RootConfig]]:
    e, wl = cfg.engine, plan.workload
    if e.kv_cache_gb is not None:
        smaller = round(e.kv_cache_gb / 2, 2)
        yield (
            f"engine.kv_cache_gb={smaller:g}",
            "a smaller KV cache (fewer sequences at once)",
            _with(cfg, "engine", kv_cache_gb=smaller),
        )
        return
    if not wl.on_gpu:  # null on CPU: already what the engine holds at once
        return
    worst = plan.worst_gpu()
    lower = round(wl.gpu_memory_utilization + min(worst.headroom, 0) / worst.device.capacity - 0.02, 2)
    if 0.05 <= lower < wl.gpu_memory_utilization:
        yield (
            f"engine.gpu_memory_utilization={lower:g}",
            "a smaller KV cache (fewer sequences at once)",
            _with(cfg, "engine", gpu_memory_utilization=lower),
        )


def _fitting_micro_batch(cfg: RootConfig, ranks: int) -> tuple[str, AlgoConfig]:
    """More data-parallel ranks split the same optimizer step: the micro-batch shrinks with them
    when train_batch_size no longer holds one micro-batch per rank."""
    a = cfg.algo
    mbs = a.micro_batch_size
    while mbs > 1 and a.train_batch_size % (mbs * ranks):
        mbs -= 1
    if mbs == a.micro_batch_size:
        return "", a
    return f" algo.micro_batch_size={mbs}", dataclasses.replace(a, micro_batch_size=mbs)


def _engine_tp_candidates(cfg: RootConfig, plan: MemoryPlan) -> Iterator[tuple[str, str, RootConfig]]:
    """When the engines' weights are the problem: twice the engines' tensor parallelism on the same
    GPUs (before more GPUs: it asks for none, though half the engines generate less at once)."""
    p = cfg.placement
    engine = next((proc for proc in plan.processes if proc.role == "engine"), None)
    if engine is None or not plan.workload.on_gpu:
        return
    weights = next(t.bytes for t in engine.terms if t.name == "weights")
    if weights > 0.5 * plan.worst_gpu().device.capacity or plan.engine_problems:
        tp = p.engine_tp * 2
        override, changes = f"placement.engine_tp={tp}", {"engine_tp": tp}
        if getattr(p, "engines", None):  # layouts given engine counts: as many GPUs, half the engines
            changes["engines"] = max(1, p.engines // 2)
            override += f" placement.engines={changes['engines']}"
        yield (
            override,
            "each engine's weights split over twice the GPUs: half the engines (less generation in parallel)",
            dataclasses.replace(cfg, placement=dataclasses.replace(p, **changes)),
        )


def _more_gpu_candidates(cfg: RootConfig, plan: MemoryPlan) -> Iterator[tuple[str, str, RootConfig]]:
    """Twice the GPUs for the trainers (sharded by ZeRO-3)."""
    p, wl = cfg.placement, plan.workload
    if not wl.on_gpu:
        return
    zero = "" if cfg.trainer.zero_stage == 3 else " trainer.zero_stage=3"
    trainer = dataclasses.replace(cfg.trainer, zero_stage=3)
    if hasattr(p, "actor_gpus"):  # split: the trainers' GPUs are counted per role
        actor, critic = p.actor_gpus * 2, p.critic_gpus * (2 if p.critic_gpus else 1)
        total = actor + critic + p.vllm_gpus
        per_node = p.gpus_per_node
        nodes = -(-total // per_node)
        moved = dataclasses.replace(p, actor_gpus=actor, critic_gpus=critic, nodes=max(nodes, p.nodes))
        override = f"placement.actor_gpus={actor}" + (f" placement.critic_gpus={critic}" if p.critic_gpus else "")
        if moved.nodes != p.nodes:
            override += f" placement.nodes={moved.nodes}"
        mbs, algo = _fitting_micro_batch(cfg, max(actor, critic))
        yield (
            override + zero + mbs,
            f"{total - p.actor_gpus - p.critic_gpus - p.vllm_gpus} more GPUs for the trainers",
            dataclasses.replace(cfg, placement=moved, trainer=trainer, algo=algo),
        )
    elif hasattr(p, "actor_fraction"):  # colocated: every role on every GPU
        gpus = p.gpus_per_node * 2
        nodes, per_node = (p.nodes, gpus) if gpus <= 8 else (p.nodes * 2, p.gpus_per_node)
        scale = (nodes * per_node) // (p.nodes * p.gpus_per_node)
        moved = dataclasses.replace(
            p,
            nodes=nodes,
            gpus_per_node=per_node,
            actor_ranks=p.actor_ranks * scale,
            critic_ranks=p.critic_ranks * scale,
            reference_ranks=p.reference_ranks * scale,
            engines=p.engines * scale,
        )
        override = (
            f"placement.nodes={nodes} placement.gpus_per_node={per_node} placement.actor_ranks={moved.actor_ranks} "
            f"placement.critic_ranks={moved.critic_ranks} placement.reference_ranks={moved.reference_ranks} "
            f"placement.engines={moved.engines}"
        )
        mbs, algo = _fitting_micro_batch(cfg, max(moved.actor_ranks, moved.critic_ranks))
        yield (
            override + zero + mbs,
            f"{nodes * per_node - p.nodes * p.gpus_per_node} more GPUs, every role sharded over them",
            dataclasses.replace(cfg, placement=moved, trainer=trainer, algo=algo),
        )


def suggest_fixes(cfg: RootConfig, plan: MemoryPlan, replan: Replan) -> list[Fix]:
    """The candidates that lower the worst device's need, in the order that costs the run least."""
    # (in shortfall, not need: a plan's worst device may be a node's host memory or a GPU)
    worst_headroom = plan.worst().headroom
    fixes = []
    for override, what, changed in _candidates(cfg, plan):
        new = replan(changed)
        if new is not None and (
            new.fits or new.worst().headroom > worst_headroom or len(new.engine_problems) < len(plan.engine_problems)
        ):
            fixes.append(Fix(override, what, changed, new))
    return fixes


def fix_chain(cfg: RootConfig, plan: MemoryPlan, replan: Replan, max_fixes: int = 8) -> list[Fix]:
    """The first fix, then the first fix of what it leaves, ... until the plan fits (or no fix is
    left): the overrides that, applied together, make the run fit."""
    chain: list[Fix] = []
    while not plan.fits and len(chain) < max_fixes:
        fixes = suggest_fixes(cfg, plan, replan)
        if not fixes:
            break
        chain.append(fixes[0])
        cfg, plan = fixes[0].config, fixes[0].plan
    return chain
