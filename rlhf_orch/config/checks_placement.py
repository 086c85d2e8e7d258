"""Cross-key checks of placement and hardware: GPUs present, the roles the plan places, fractions
and rank counts per layout, engine memory, offloading, the reference's memory, LoRA on the engines,
the launcher (`rlhf_orch.config.validate.CHECKS` runs them)."""

from __future__ import annotations

import math
import os
from typing import Optional

from launchers.options import ClusterLauncherConfig, LocalLauncherConfig
from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.ranges import is_int, is_real
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.models.options import LoraConfig
from rlhf_orch.reward.options import ModelRewardConfig
from rlhf_orch.topology.options import ColocatedPlacementConfig, CpuLocalPlacementConfig, SplitPlacementConfig
from rlhf_orch.topology.plan import PlacementPlan


def gpus(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    need = plan.total_gpus
    if need <= hw.gpus:
        return []
    fix = (
        "use placement=cpu_local on a machine without GPUs, or set launcher.logical_gpus="
        f"{int(need + 0.999)} to emulate GPUs with Ray logical GPUs (CPU testing only)"
        if not hw.cuda
        else f"ask for at most {hw.gpus} GPUs (placement.gpus_per_node x placement.nodes) or run on a larger cluster"
    )
    return [Problem("placement", f"{plan.layout} needing {need:g} GPUs, {hw.gpus} present", fix)]


def engine_memory(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    e = cfg.engine
    problems = []
    if is_int(e.sleep_level) and e.sleep_level > 0 and plan.total_gpus == 0:
        problems.append(
            Problem(
                "engine.sleep_level",
                e.sleep_level,
                "vLLM's sleep mode frees GPU memory and needs a GPU layout; use 0 (or null) with placement=cpu_local",
            )
        )
    if e.gpu_memory_utilization is not None and plan.total_gpus == 0:
        problems.append(
            Problem(
                "engine.gpu_memory_utilization",
                e.gpu_memory_utilization,
                "CPU engines size their KV cache by engine.kv_cache_gb only; leave it null with placement=cpu_local",
            )
        )
    if e.gpu_memory_utilization is not None and e.kv_cache_gb is not None and plan.total_gpus > 0:
        problems.append(
            Problem(
                "engine.gpu_memory_utilization",
                e.gpu_memory_utilization,
                "vLLM ignores it when the KV "
                f"cache size is given (engine.kv_cache_gb={e.kv_cache_gb:g}): leave one of the two null",
            )
        )
    return problems


def roles(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    needed = ["actor", "engine"] + ["critic"] * cfg.algo.needs_critic + ["reference"] * cfg.algo.needs_reference_ranks
    for role in needed:
        if not plan.slots_for(role):
            problems.append(
                Problem(f"placement ({plan.layout})", f"no {role}", f"the plan must place at least one {role}")
            )
    return problems


def placement(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """Relations between placement keys (the planner refuses most of them first, one at a time)."""
    p = cfg.placement
    problems = []
    if isinstance(p, CpuLocalPlacementConfig) or p.engine_tp < 1 or p.gpus_per_node < 1 or p.nodes < 1:
        return problems
    if p.gpus_per_node % p.engine_tp:
        problems.append(
            Problem(
                "placement.engine_tp",
                p.engine_tp,
                f"must divide placement.gpus_per_node={p.gpus_per_node}, "
                "or an engine's tensor-parallel GPUs would straddle two nodes",
            )
        )
    capacity = p.nodes * p.gpus_per_node
    if isinstance(p, ColocatedPlacementConfig):
        roles = {"actor": p.actor_fraction, "engine": p.engine_fraction}
        if cfg.algo.needs_critic:
            roles["critic"] = p.critic_fraction
        if cfg.algo.needs_reference_ranks:
            roles["reference"] = p.reference_fraction
        if isinstance(cfg.reward, ModelRewardConfig):
            roles["reward"] = p.reference_fraction  # a reward model claims the reference's share
        if all(is_real(v) for v in roles.values()) and sum(roles.values()) > 1 + 1e-9:
            keys = sorted({"reference" if r == "reward" else r for r in roles})
            problems.append(
                Problem(
                    "+".join(f"placement.{k}_fraction" for k in keys),
                    round(sum(roles.values()), 6),
                    f"every role ({', '.join(roles)}) shares GPU 0, so their fractions must sum to <= 1; lower them",
                )
            )
        util = cfg.engine.gpu_memory_utilization
        if is_real(util) and is_real(p.engine_fraction) and util > p.engine_fraction + 1e-9:
            problems.append(
                Problem(
                    "engine.gpu_memory_utilization",
                    util,
                    "on a colocated GPU vLLM reserves this fraction of the WHOLE GPU's memory at start, more than "
                    f"the engine's planned share placement.engine_fraction={p.engine_fraction:g}; the trainer "
                    "processes sharing the GPU need the rest: lower it to <= engine_fraction (or leave it null "
                    "to use engine_fraction), or raise placement.engine_fraction and lower the others",
                )
            )
        placed = (
            ("actor_ranks",)
            + ("critic_ranks",) * cfg.algo.needs_critic
            + ("reference_ranks",) * cfg.algo.needs_reference_ranks
        )
        for key in placed:  # the planner gives a role the algorithm does not use no ranks
            ranks = getattr(p, key)
            if ranks > capacity:
                problems.append(
                    Problem(
                        f"placement.{key}",
                        ranks,
                        f"colocated ranks sit one per GPU: use <= {capacity} "
                        f"(placement.nodes x placement.gpus_per_node) or add nodes/GPUs",
                    )
                )
        if p.engines * p.engine_tp > capacity:
            problems.append(
                Problem(
                    "placement.engines",
                    p.engines,
                    f"engines x engine_tp = {p.engines * p.engine_tp} GPUs "
                    f"exceed the {capacity} of placement.nodes x placement.gpus_per_node: use <= "
                    f"{capacity // p.engine_tp} engines or add nodes/GPUs",
                )
            )
    if isinstance(p, SplitPlacementConfig) and p.ratio is None:
        critic = p.critic_gpus if cfg.algo.needs_critic else 0
        if p.actor_gpus + p.critic_gpus + p.vllm_gpus > capacity and min(p.actor_gpus, p.critic_gpus, p.vllm_gpus) >= 0:
            problems.append(
                Problem(
                    "placement.vllm_gpus",
                    p.vllm_gpus,
                    f"actor_gpus + critic_gpus + vllm_gpus = "
                    f"{p.actor_gpus + p.critic_gpus + p.vllm_gpus} exceed the {capacity} GPUs of placement.nodes x "
                    "placement.gpus_per_node: lower the per-role GPUs or add nodes/GPUs",
                )
            )
        vllm = p.vllm_gpus + (p.critic_gpus - critic)  # a critic-free algorithm gives the critic's GPUs to vLLM
        if vllm >= 1 and vllm % p.engine_tp:
            problems.append(
                Problem(
                    "placement.vllm_gpus",
                    p.vllm_gpus,
                    f"vLLM gets {vllm} GPUs, not a multiple of placement.engine_tp={p.engine_tp}: make it one",
                )
            )
    return problems


def lora(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """model.lora: keys that do nothing at rank 0; what an adapter-serving engine cannot do."""
    lora, defaults = cfg.model.lora, LoraConfig()
    if lora.rank == 0:
        return [
            Problem(
                f"model.lora.{key}",
                getattr(lora, key),
                "does nothing at model.lora.rank=0 (full fine-tuning): set model.lora.rank > 0 or drop the key",
            )
            for key in ("alpha", "dropout", "target_modules", "sync")
            if getattr(lora, key) != getattr(defaults, key)
        ]
    problems = []
    if lora.sync != "merged" and cfg.engine.sleep_level == 2:
        # (auto too: it takes the adapter wherever vLLM serves one, which is known only in the engine)
        problems.append(
            Problem(
                "engine.sleep_level",
                2,
                "level 2 drops the engines' base weights and an adapter update "
                "does not bring them back: use engine.sleep_level=1, or model.lora.sync=merged",
            )
        )
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    refused = LoraSettings(rank=lora.rank, target_modules=targets).refused_targets()
    if refused:
        problems.append(
            Problem(
                "model.lora.target_modules",
                targets,
                f"no adapter on the embedding or the output head "
                f"({refused}): target the decoder's linear layers (q_proj, ..., or all-linear)",
            )
        )
    return problems


def offload(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    if cfg.trainer.offload_optimizer and not hw.cuda:
        return [
            Problem(
                "trainer.offload_optimizer",
                True,
                "offloading moves optimizer states from GPU to host memory; "
                "without CUDA GPUs they are in host memory already: drop it (a dry run plans a GPU layout "
                "with it: launcher.dry_run=true)",
            )
        ]
    return []


def reference_memory(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """trainer.reference_memory: refused where it does nothing or cannot be done."""
    how = cfg.trainer.reference_memory
    if how == "full":
        return []
    ranks = plan.num_ranks("reference")
    if ranks == 0:
        why = (
            "the algorithm has no KL reference or teacher"
            if not cfg.algo.needs_reference_ranks
            else "no reference rank is planned"
        )
        return [Problem("trainer.reference_memory", how, f"does nothing: {why}; drop the key")]
    if cfg.model.lora.rank > 0 and plan.reference_in_actor and not cfg.algo.uses_teacher:
        return [
            Problem(
                "trainer.reference_memory",
                how,
                "does nothing: under model.lora the policy ranks' reference is "
                "the policy's own frozen base (no second copy); drop the key",
            )
        ]
    if how == "offloaded" and not hw.cuda:
        return [
            Problem(
                "trainer.reference_memory",
                how,
                "offloading keeps the reference's shards in host memory instead "
                "of GPU memory; without CUDA GPUs it is in host memory already: use full or sharded",
            )
        ]
    if how == "sharded" and ranks == 1:
        return [
            Problem(
                "trainer.reference_memory",
                how,
                "sharding over one reference rank keeps the whole model: plan more "
                "reference ranks (placement.reference_ranks, or the policy's ranks with "
                "placement.reference_in_actor), or use offloaded (GPU layouts)",
            )
        ]
    return []


def launcher(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    lc = cfg.launcher
    problems = []
    if lc.keep_actors and not lc.reuse_session:
        problems.append(
            Problem(
                "launcher.keep_actors",
                lc.keep_actors,
                "keeps a run's actors for the next run in "
                "the same Ray session: set launcher.reuse_session=true too, or leave keep_actors false",
            )
        )
    if isinstance(lc, ClusterLauncherConfig):
        if lc.logical_gpus:
            problems.append(
                Problem(
                    "launcher.logical_gpus",
                    lc.logical_gpus,
                    "cannot be applied to a running cluster: "
                    "give `ray start --num-gpus=N` on each node, or use launcher=local",
                )
            )
        if lc.num_cpus is not None:
            problems.append(
                Problem(
                    "launcher.num_cpus",
                    lc.num_cpus,
                    "cannot be applied to a running cluster: "
                    "give `ray start --num-cpus=N` on each node, or use launcher=local",
                )
            )
    elif isinstance(lc, LocalLauncherConfig):
        if lc.address not in (None, "local"):
            problems.append(
                Problem(
                    "launcher.address",
                    lc.address,
                    "launcher=local starts its own Ray; to join a "
                    "cluster use launcher=cluster launcher.address=..., else leave address null",
                )
            )
        if not lc.dry_run and (lc.num_cpus is None or lc.num_cpus >= 1):
            cpus = lc.num_cpus if lc.num_cpus is not None else _default_logical_cpus()
            if cpus is not None and plan.total_cpus > cpus:
                need = math.ceil(plan.total_cpus)
                problems.append(
                    Problem(
                        "launcher.num_cpus",
                        lc.num_cpus,
                        f"the {plan.layout} plan reserves {plan.total_cpus:g} "
                        f"logical CPUs (one per process) but Ray would offer {cpus}, so its placement groups "
                        f"could never start: set launcher.num_cpus={need} (or more)",
                    )
                )
    return problems


def _default_logical_cpus() -> Optional[int]:
    from rlhf_orch.topology.placement import MIN_LOGICAL_CPUS

    return max(os.cpu_count() or 1, MIN_LOGICAL_CPUS)
