"""Checks of derived quantities, run on the driver before Ray or any actor starts.

Each check is a small function returning the problems it found; every problem names the config
key, the value it has, and the fix. `validate` runs them all and raises one `ConfigError`
listing every problem, so a user fixes everything in one go.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.topology.plan import PlacementPlan


@dataclass(frozen=True)
class Problem:
    key: str
    value: object
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.fix}"


class ConfigError(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}")


@dataclass(frozen=True)
class Hardware:
    """What this machine (or the Ray cluster) offers, as far as checks need to know."""

    gpus: int  # GPUs Ray will offer (real, or logical when launcher.logical_gpus is set)
    cuda: bool  # real CUDA devices present (NCCL and CUDA IPC need them)


def _batch_sizes(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    a = cfg.algo
    problems = []
    seqs = a.rollout_batch_size * a.samples_per_prompt
    if seqs % a.train_batch_size:
        problems.append(
            Problem(
                "algo.train_batch_size",
                a.train_batch_size,
                f"must divide algo.rollout_batch_size x algo.samples_per_prompt = {seqs}; "
                f"use a divisor of {seqs} (e.g. {_largest_divisor_at_most(seqs, a.train_batch_size)})",
            )
        )
    for role in ("actor", "critic"):
        dp = len(plan.slots_for(role))
        if dp == 0:
            continue
        if seqs % dp:
            problems.append(
                Problem(
                    f"placement.{role}_ranks",
                    dp,
                    f"{seqs} sequences per step (rollout_batch_size x samples_per_prompt) do not split over "
                    f"{dp} {role} ranks; use a rank count dividing {seqs} or change algo.rollout_batch_size",
                )
            )
        elif a.train_batch_size % (a.micro_batch_size * dp):
            problems.append(
                Problem(
                    "algo.micro_batch_size",
                    a.micro_batch_size,
                    f"algo.train_batch_size={a.train_batch_size} must be a multiple of micro_batch_size x {role} "
                    f"data-parallel size ({a.micro_batch_size} x {dp}); pick micro_batch_size dividing "
                    f"{a.train_batch_size // dp if a.train_batch_size % dp == 0 else a.train_batch_size}",
                )
            )
    actor_dp = len(plan.slots_for("actor"))
    critic_dp = len(plan.slots_for("critic"))
    if actor_dp and critic_dp and actor_dp % critic_dp:
        problems.append(
            Problem(
                "placement.critic_ranks",
                critic_dp,
                f"experience is sharded over the {actor_dp} actor ranks and each critic rank takes whole shards; "
                f"use a critic rank count that divides {actor_dp}",
            )
        )
    return problems


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(min(n, k), 1) + 1) if n % d == 0)


def _gpus(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
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


def _lengths(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    d, m = cfg.data, cfg.model
    total = d.prompt_max_len + d.response_max_len
    if total > m.context_len:
        return [
            Problem(
                "data.response_max_len",
                d.response_max_len,
                f"data.prompt_max_len + data.response_max_len = {total} exceeds model.context_len={m.context_len}; "
                f"lower data.response_max_len to {max(m.context_len - d.prompt_max_len, 0)} or pick a longer-context model",
            )
        ]
    return []


# Transports that need real CUDA devices, with the CPU alternative to name in the fix.
_CUDA_BACKENDS = {
    "nccl": ("NCCL", "use the gloo variant of the same strategy (e.g. sync=gloo_bucketed instead of sync=nccl_bucketed)"),
    "cuda_ipc": ("CUDA IPC", "use sync=gloo_bucketed (or sync=object_store where no collective group can be formed)"),
}


def _sync_backend(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    sync = cfg.sync
    backend = sync.backend
    # What the chosen strategy needs is declared on its schema (ClassVars), not listed here.
    if backend not in sync.backends:
        problems.append(Problem("sync.backend", backend, f"this strategy supports {' or '.join(map(repr, sync.backends))}"))
    elif backend in _CUDA_BACKENDS and not hw.cuda:
        problems.append(
            Problem(
                "sync.backend",
                backend,
                f"{_CUDA_BACKENDS[backend][0]} needs CUDA GPUs and this machine has none; {_CUDA_BACKENDS[backend][1]}",
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
    senders = getattr(sync, "senders", None)
    if senders is not None and senders < 1:
        problems.append(Problem("sync.senders", senders, "must be >= 1 (policy ranks that send at once)"))
    shard_by = getattr(sync, "shard_by", None)
    if shard_by is not None and shard_by not in ("buckets", "engines"):
        problems.append(Problem("sync.shard_by", shard_by, "use 'buckets' (each sender a share of the buckets) or 'engines'"))
    bucket_mb = getattr(sync, "bucket_mb", None)
    if bucket_mb is not None and bucket_mb <= 0:
        problems.append(Problem("sync.bucket_mb", bucket_mb, "must be > 0 (typical: 64-1024)"))
    return problems


def _algorithm(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    from rlhf_orch.algo.losses import KL_DIVERGENCE_ESTIMATORS, LOSS_AGGREGATIONS

    a = cfg.algo
    problems = []
    for key in ("num_steps", "rollout_batch_size", "samples_per_prompt", "train_batch_size", "micro_batch_size", "ppo_epochs"):
        if getattr(a, key) < 1:
            problems.append(Problem(f"algo.{key}", getattr(a, key), "must be >= 1"))
    for key in ("clip_low", "clip_high"):
        if not 0 < getattr(a, key) < 1:
            problems.append(Problem(f"algo.{key}", getattr(a, key), "must be in (0, 1), typically 0.2 (DAPO: clip_high 0.28)"))
    if a.loss_agg not in LOSS_AGGREGATIONS:
        problems.append(Problem("algo.loss_agg", a.loss_agg, f"use one of {', '.join(LOSS_AGGREGATIONS)}"))
    if a.loss_agg_norm_len < 0:
        problems.append(Problem("algo.loss_agg_norm_len", a.loss_agg_norm_len, "must be >= 0 (0 = data.response_max_len)"))
    if a.kl_placement not in ("in_reward", "in_loss", "off"):
        problems.append(Problem("algo.kl_placement", a.kl_placement, "use 'in_reward' (a reward penalty), 'in_loss' (a loss term) or 'off'"))
    elif a.kl_placement == "in_reward" and a.kl_estimator not in ("k1", "k2"):
        problems.append(
            Problem(
                "algo.kl_estimator",
                a.kl_estimator,
                "as a reward penalty use 'k1' (or 'k2'): k3/low_var_kl's gradient there is biased; "
                "for k3 set algo.kl_placement=in_loss",
            )
        )
    elif a.kl_estimator not in KL_DIVERGENCE_ESTIMATORS:
        problems.append(Problem("algo.kl_estimator", a.kl_estimator, f"use one of {', '.join(KL_DIVERGENCE_ESTIMATORS)}"))
    for key in ("kl_coef", "entropy_coef", "actor_lr", "grad_clip"):
        if getattr(a, key) < 0:
            problems.append(Problem(f"algo.{key}", getattr(a, key), "must be >= 0"))
    if a.temperature <= 0:
        problems.append(Problem("algo.temperature", a.temperature, "must be > 0 (policy-gradient methods need sampled responses)"))
    if a.group_estimator and a.samples_per_prompt < 2:
        problems.append(
            Problem(
                "algo.samples_per_prompt",
                a.samples_per_prompt,
                "a group estimator compares the samples of one prompt: use >= 2 (typically 4-16)",
            )
        )
    if a.group_estimator and a.kl_placement == "in_reward":
        problems.append(
            Problem(
                "algo.kl_placement",
                a.kl_placement,
                "outcome advantages take one score per sample; put the KL in the loss (algo.kl_placement=in_loss) or turn it off",
            )
        )
    if getattr(a, "dynamic_sampling", False):
        if cfg.transfer._target_ != "rlhf_orch.transfer.packed.PackedTransfer":
            problems.append(
                Problem(
                    "algo.dynamic_sampling",
                    True,
                    "dynamic sampling keeps samples on the engines until the batch is full, which the packed "
                    "hand-over does: use transfer=packed (or algo.dynamic_sampling=false)",
                )
            )
        if cfg.reward.scores_after_handover:
            problems.append(
                Problem(
                    "algo.dynamic_sampling",
                    True,
                    "dynamic sampling filters groups before the hand-over, but a reward model scores after it: "
                    "use a rule reward, or algo.dynamic_sampling=false",
                )
            )
        if getattr(a, "max_gen_batches", 1) < 1:
            problems.append(Problem("algo.max_gen_batches", a.max_gen_batches, "must be >= 1 (rollout rounds per step)"))
    for key in ("gamma", "lam"):
        value = getattr(a, key, None)
        if value is not None and not 0 <= value <= 1:
            problems.append(Problem(f"algo.{key}", value, "must be in [0, 1]"))
    if getattr(a, "value_clip_eps", 1.0) <= 0:
        problems.append(Problem("algo.value_clip_eps", a.value_clip_eps, "must be > 0 (typically 0.2)"))
    if getattr(a, "overlong_buffer", 0) < 0 or getattr(a, "overlong_buffer", 0) >= cfg.data.response_max_len > 0:
        problems.append(
            Problem("algo.overlong_buffer", a.overlong_buffer, f"must be in [0, data.response_max_len={cfg.data.response_max_len})")
        )
    if cfg.trainer.zero_stage not in (0, 1, 2, 3):
        problems.append(Problem("trainer.zero_stage", cfg.trainer.zero_stage, "DeepSpeed ZeRO stages are 0, 1, 2 or 3"))
    return problems


def _roles(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    needed = ["actor", "engine"] + ["critic"] * cfg.algo.needs_critic + ["reference"] * cfg.algo.needs_reference
    for role in needed:
        if not plan.slots_for(role):
            problems.append(Problem(f"placement ({plan.layout})", f"no {role}", f"the plan must place at least one {role}"))
    return problems


def _transfer(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """Rollout transfer knobs: the in-flight bound and the packed token budget vs sequence length."""
    t, d, a = cfg.transfer, cfg.data, cfg.algo
    problems = []
    if t.max_in_flight < 1:
        problems.append(Problem("transfer.max_in_flight", t.max_in_flight, "must be >= 1 (micro-batches handed over but not yet staged; typical 2-8)"))
    longest = d.prompt_max_len + d.response_max_len
    if t.token_budget < 0:
        problems.append(Problem("transfer.token_budget", t.token_budget, f"must be >= 0; 0 derives algo.micro_batch_size x {longest}"))
    elif 0 < t.token_budget < longest:
        problems.append(
            Problem(
                "transfer.token_budget",
                t.token_budget,
                f"a sequence can be data.prompt_max_len + data.response_max_len = {longest} tokens and must fit one "
                f"micro-batch; set transfer.token_budget >= {longest} (or 0 to derive {a.micro_batch_size} x {longest})",
            )
        )
    return problems


def _evaluation(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    e = cfg.eval
    problems = []
    for key in ("every_n_steps", "num_prompts"):
        if getattr(e, key) < 0:
            problems.append(Problem(f"eval.{key}", getattr(e, key), "must be >= 0 (0 = off / the whole validation set)"))
    if e.samples_per_prompt < 1:
        problems.append(Problem("eval.samples_per_prompt", e.samples_per_prompt, "must be >= 1 (the k of mean@k and pass@k)"))
    if e.temperature < 0:
        problems.append(Problem("eval.temperature", e.temperature, "must be >= 0 (0 = greedy)"))
    if e.temperature == 0 and e.samples_per_prompt > 1:
        problems.append(
            Problem(
                "eval.samples_per_prompt",
                e.samples_per_prompt,
                "greedy decoding (eval.temperature=0) gives k identical samples; set eval.temperature > 0 "
                "(e.g. 0.6) for pass@k with k > 1, or eval.samples_per_prompt=1",
            )
        )
    return problems


def _model_source(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    path = getattr(cfg.model, "name_or_path", None)
    if path and (path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists()):
        return [Problem("model.name_or_path", path, "no such directory; give an existing checkpoint directory or a hub id")]
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        return [Problem("model.dtype", cfg.model.dtype, "use float32 (CPU), bfloat16 or float16")]
    return []


CHECKS: tuple[Callable[[RootConfig, PlacementPlan, Hardware], list[Problem]], ...] = (
    _batch_sizes,
    _gpus,
    _lengths,
    _sync_backend,
    _algorithm,
    _roles,
    _model_source,
    _transfer,
    _evaluation,
)


def validate(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> None:
    problems = [p for check in CHECKS for p in check(cfg, plan, hw)]
    if problems:
        raise ConfigError(problems)
