"""Cross-key checks of how a run moves weights and overlaps phases: the sync strategy against the
hardware and layout, the pipeline against the transfer and the algorithm, timeouts against the step's
(`rlhf_orch.config.validate.CHECKS` runs them)."""

from __future__ import annotations

from hydra.utils import get_class

from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.ranges import is_real, lookup
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.topology.plan import PlacementPlan


# Transports that need real CUDA devices, with the CPU alternative to name in the fix.
_CUDA_BACKENDS = {
    "nccl": (
        "NCCL",
        "use the gloo variant of the same strategy (e.g. sync=gloo_bucketed instead of sync=nccl_bucketed)",
    ),
    "cuda_ipc": ("CUDA IPC", "use sync=gloo_bucketed (or sync=object_store where no collective group can be formed)"),
}


def sync_backend(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    sync = cfg.sync
    backend = sync.backend
    # What the chosen strategy needs is declared on its schema (ClassVars), not listed here.
    if backend not in sync.backends:
        problems.append(
            Problem("sync.backend", backend, f"this strategy supports {' or '.join(map(repr, sync.backends))}")
        )
    elif backend in _CUDA_BACKENDS and not hw.cuda:
        problems.append(
            Problem(
                "sync.backend",
                backend,
                f"{_CUDA_BACKENDS[backend][0]} needs CUDA GPUs where the roles run and there are none; {_CUDA_BACKENDS[backend][1]}",
            )
        )
    if sync.needs_colocated_engines and plan.layout != "colocated":
        problems.append(
            Problem(
                "placement",
                plan.layout,
                "CUDA IPC hands over GPU memory, so every engine must share a GPU with the policy: "
                "use placement=colocated, or sync=nccl_bucketed for separate GPUs",
            )
        )
    if sync.needs_colocated_engines and plan.layout == "colocated":
        from rlhf_orch.topology.plan import ipc_feeds, unfed_ipc_workers

        missing = unfed_ipc_workers(ipc_feeds(plan))
        if missing:
            where = ", ".join(f"engine{f.engine}/tp{f.tp_rank} on node {f.node} GPU {f.bundle}" for f in missing)
            problems.append(
                Problem(
                    "placement.actor_ranks",
                    cfg.placement.actor_ranks,
                    f"CUDA IPC opens memory of the same GPU only, and no policy rank sits on {where}: raise "
                    "placement.actor_ranks so every engine GPU has one, or use sync=nccl_bucketed",
                )
            )
    actor_ranks = len(plan.slots_for("actor"))
    if actor_ranks < sync.min_policy_ranks:
        problems.append(
            Problem(
                "placement.actor_ranks",
                actor_ranks,
                f"this sync strategy shards the sending over >= {sync.min_policy_ranks} policy ranks; set "
                f"placement.actor_ranks={sync.min_policy_ranks} (or more), or use sync=gloo_bucketed with one rank",
            )
        )
    return problems


def pipeline(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """An overlapping pipeline holds a finished rollout until the trainers are free: ask the
    chosen pipeline and transfer classes what they need and can do."""
    # The transfer class (it imports torch, ~1.5 s) is asked only when the pipeline needs something.
    if get_class(cfg.pipeline._target_).needs_held_rollouts and not get_class(cfg.transfer._target_).holds_rollouts:
        return [
            Problem(
                "transfer",
                cfg.transfer._target_.rsplit(".", 1)[-1],
                "this pipeline generates the next rollout while the trainers train, so the rollout must wait on the "
                "engines until they are free; a streaming transfer hands it to them during generation: "
                "use transfer=packed (or padded), or pipeline=sync",
            )
        ]
    staleness = getattr(cfg.pipeline, "max_staleness", 0)
    if staleness > 0 and getattr(cfg.algo, "dynamic_sampling", False):
        return [
            Problem(
                "pipeline.max_staleness",
                staleness,
                "dynamic sampling draws its further prompts while the next rollouts generate at once, so which prompts "
                "a step trains on would depend on timing (no exact resume): use pipeline=one_step_off, or "
                "pipeline.max_staleness=0, or algo.dynamic_sampling=false",
            )
        ]
    return []


def timeouts(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """A shorter outer timeout makes an inner one unreachable."""
    step = lookup(cfg, "fault.step_timeout_s")
    if not is_real(step) or step <= 0:
        return []
    problems = []
    if is_real(cfg.sync.timeout_s) and cfg.sync.timeout_s > step:
        problems.append(
            Problem(
                "fault.step_timeout_s",
                step,
                f"a step waits on the weight sync, so sync.timeout_s="
                f"{cfg.sync.timeout_s:g} could never fire: use fault.step_timeout_s >= {cfg.sync.timeout_s:g} "
                "(or a lower sync.timeout_s)",
            )
        )
    for key in ("reward.timeout_s", "reward.rule.timeout_s"):
        limit = lookup(cfg, key)
        if is_real(limit) and limit > step:
            problems.append(
                Problem(
                    key,
                    limit,
                    f"one sample's scoring limit exceeds fault.step_timeout_s={step:g}, the longest "
                    "wait without progress (each scored sample counts as the engine's progress, one sample "
                    "takes up to this): use less (typical 10)",
                )
            )
    tool = lookup(cfg, "env.tool_timeout_s")
    env_class = get_class(cfg.env._target_) if isinstance(getattr(cfg.env, "_target_", None), str) else None
    if is_real(tool) and hasattr(env_class, "step_wait_s") and env_class.step_wait_s(tool) > step:
        # While every trajectory on an engine waits in a tool call the engine makes no step: past
        # fault.step_timeout_s it would be taken for a hung engine and the run restarted.
        problems.append(
            Problem(
                "env.tool_timeout_s",
                tool,
                f"one environment step may take {env_class.step_wait_s(tool):g}s, more than "
                f"fault.step_timeout_s={step:g}, the longest wait without an engine step: use less (or raise fault.step_timeout_s)",
            )
        )
    return problems
