"""Checks of values and derived quantities, run on the driver before Ray or any actor starts.

Each check is a small function returning the problems it found; every problem names the config
key, the value it has, and the fix. `validate` runs them all and raises one `ConfigError`
listing every problem, so a user fixes everything in one go.

The valid range of every single key is one row of `RANGES` (key path, predicate, fix), evaluated
over the typed config; a row whose key the chosen group option does not have is skipped. Checks
between keys (sums, divisibility, one key against another) are the functions in `CHECKS`.
Some of these are also refused by the constructors or the planner (which stop at the first
problem); they are repeated here so that `validate` reports everything at once.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.utils import get_class

from rlhf_orch.config.schema import (
    ClusterLauncherConfig,
    ColocatedPlacementConfig,
    CountdownRuleConfig,
    CpuLocalPlacementConfig,
    DigitRuleConfig,
    DigitTaskConfig,
    FilesDataConfig,
    GSM8KRuleConfig,
    LocalLauncherConfig,
    MathVerifyRuleConfig,
    ModelRewardConfig,
    RootConfig,
    SplitPlacementConfig,
    TinyModelConfig,
    WandbLoggerConfig,
)
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


# =========================================================================== ranges of single keys
_ABSENT = object()


@dataclass(frozen=True)
class Range:
    """One key's valid values: `ok(value)` must hold, else `Problem(key, value, fix)`."""

    key: str  # dotted path in RootConfig; skipped when the chosen option has no such field
    ok: Callable[[Any], bool]
    fix: str
    when: Optional[Callable[[RootConfig], bool]] = None  # the row applies only when this holds
    nullable: bool = False  # None is a valid value (the key's "off"/"derive" setting)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def ints(key: str, lo: int, why: str = "", hi: Optional[int] = None, **kw: Any) -> Range:
    bound = f"must be >= {lo}" if hi is None else f"must be in [{lo}, {hi}]"
    return Range(key, lambda v: _is_int(v) and v >= lo and (hi is None or v <= hi), bound + _why(why), **kw)


def reals(
    key: str,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    why: str = "",
    **kw: Any,
) -> Range:
    """A finite number with optional bounds (open or closed)."""

    def ok(v: Any) -> bool:
        if not _is_real(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        if hi is not None and (v >= hi if hi_open else v > hi):
            return False
        return True

    if lo is not None and hi is not None:
        bound = f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        bound = f"must be {'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        bound = f"must be {'<' if hi_open else '<='} {hi:g}"
    else:
        bound = "must be a finite number"
    return Range(key, ok, bound + _why(why), **kw)


def choice(key: str, options: tuple, fix: Optional[str] = None, **kw: Any) -> Range:
    return Range(key, lambda v: v in options, fix or f"use one of {', '.join(map(repr, options))}", **kw)


def text(key: str, why: str = "", **kw: Any) -> Range:
    return Range(key, lambda v: isinstance(v, str) and v.strip() != "", "must be a non-empty string" + _why(why), **kw)


def _needs_critic(c: RootConfig) -> bool:
    return c.algo.needs_critic


def _needs_reference(c: RootConfig) -> bool:
    return c.algo.needs_reference


def _gpu_layout(c: RootConfig) -> bool:
    return not isinstance(c.placement, CpuLocalPlacementConfig)


_SEED_MAX = 2**32 - 1
_SEED_WHY = "numpy, torch and vLLM seeds"
_RATIO = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def _ratio_ok(v: Any) -> bool:
    m = _RATIO.match(str(v))
    return bool(m) and int(m.group(1)) >= 1 and int(m.group(2)) >= 1


def _files_ok(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(f, str) and f.strip() for f in v)


def _columns_ok(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(c, str) and c.strip() for c in v)


_WANDB_BAD_CHARS = "/\\#?%:"

RANGES: tuple[Range, ...] = (
    # ---- placement
    ints("placement.actor_ranks", 1, "the policy needs at least one rank"),
    ints("placement.critic_ranks", 1, "this algorithm has a critic", when=_needs_critic),
    ints("placement.critic_ranks", 0, "unused without a critic", when=lambda c: not c.algo.needs_critic),
    ints("placement.reference_ranks", 1, "the KL term needs a reference rank", when=_needs_reference),
    ints("placement.reference_ranks", 0, "unused without a KL term", when=lambda c: not c.algo.needs_reference),
    ints("placement.engines", 1, "rollouts need at least one vLLM engine"),
    ints("placement.engine_tp", 1, "GPUs (CPU workers) per engine"),
    ints("placement.nodes", 1, "plan at least one node", when=_gpu_layout),
    ints("placement.gpus_per_node", 1, "GPU layouts need GPUs; use placement=cpu_local on CPU machines", when=_gpu_layout),
    Range("placement.nodes", lambda v: v == 1, "placement=cpu_local runs everything on this machine: set placement.nodes=1",
          when=lambda c: isinstance(c.placement, CpuLocalPlacementConfig)),
    Range("placement.gpus_per_node", lambda v: v == 0, "placement=cpu_local uses no GPUs: set placement.gpus_per_node=0",
          when=lambda c: isinstance(c.placement, CpuLocalPlacementConfig)),
    *(reals(f"placement.{k}_fraction", 0, 1, lo_open=True, why="a role's share of one GPU, e.g. 0.25",
            when=lambda c: isinstance(c.placement, ColocatedPlacementConfig))
      for k in ("actor", "critic", "reference", "engine")),
    reals("placement.reference_fraction", 0, 1, lo_open=True, hi_open=True,
          why="the reference's share of each actor GPU; the actor keeps the rest",
          when=lambda c: isinstance(c.placement, SplitPlacementConfig)),
    Range("placement.ratio", _ratio_ok, "write it 'trainer:vllm' with two positive integers, e.g. '3:1', or null "
          "to give actor_gpus/critic_gpus/vllm_gpus", nullable=True),
    ints("placement.actor_gpus", 1, "the actor needs at least one GPU"),
    ints("placement.critic_gpus", 1, "the critic needs at least one GPU", when=_needs_critic),
    ints("placement.critic_gpus", 0, "without a critic these GPUs join vllm_gpus", when=lambda c: not c.algo.needs_critic),
    ints("placement.vllm_gpus", 1, "vLLM needs at least one GPU"),
    # ---- transfer
    ints("transfer.max_in_flight", 1, "micro-batches handed over but not yet staged; typical 2-8"),
    # transfer.token_budget: `_transfer` (its fix names the sequence length)
    # ---- sync (backend: `_sync_backend`, it depends on the strategy and the hardware)
    reals("sync.timeout_s", 0, lo_open=True, why="seconds one weight sync may take"),
    reals("sync.bucket_mb", 0, lo_open=True, why="typical: 64-1024"),
    ints("sync.senders", 1, "policy ranks that send at once"),
    choice("sync.shard_by", ("buckets", "engines"), "use 'buckets' (each sender a share of the buckets) or 'engines'"),
    # ---- data
    ints("data.prompt_max_len", 1, "tokens"),
    ints("data.response_max_len", 1, "tokens"),
    ints("data.seed", 0, _SEED_WHY, hi=_SEED_MAX),
    ints("data.min_digits", 1, "digits of the shortest task"),
    ints("data.max_digits", 1, "digits of the longest task"),
    ints("data.filler_tokens", 0, "extra context tokens in front of the task"),
    ints("data.eval_size", 0, "held-out prompts; 0 = none"),
    Range("data.train_files", _files_ok, "give at least one file: data.train_files=[/path/train.parquet] "
          "(.parquet, .jsonl, .json or hf:<name>[:<config>]@<split>)"),
    Range("data.val_files", lambda v: isinstance(v, (list, tuple)) and all(isinstance(f, str) and f.strip() for f in v),
          "must be a list of file names (empty: no validation set)"),
    choice("data.overlong", ("error", "filter"), "use 'error' (stop on a prompt longer than data.prompt_max_len) or "
           "'filter' (drop it)"),
    text("data.prompt_key", "a column name, or null with data.prompt_template", nullable=True),
    text("data.label_key", "a column name (dots read nested fields), or null", nullable=True),
    text("data.source_key", "the column naming each row's data source"),
    text("data.extra_key", "the column with extra per-row information"),
    text("data.default_source", "the source name of rows without one; it names the eval/<source>/ metrics"),
    Range("data.label_columns", _columns_ok, "must be a non-empty list of column names, or null", nullable=True),
    # ---- reward
    reals("reward.timeout_s", 0, lo_open=True, why="seconds one sample may take to score"),
    ints("reward.pool_size", 0, "0 scores inline on the engines, N in N Ray tasks"),
    choice("reward.method", ("strict", "flexible"), "use 'strict' (the number after ####) or 'flexible' (the last number)",
           when=lambda c: isinstance(c.reward, GSM8KRuleConfig)),
    reals("reward.format_score"),
    reals("reward.score"),
    reals("reward.weight", why="multiplies the reward model's score"),
    reals("reward.rule_weight", why="multiplies the rule's score"),
    ints("reward.micro_batch_size", 1, "sequences per reward-model forward pass"),
    Range("reward.name", lambda v: isinstance(v, str) and v.isidentifier(),
          "must be the name of the function in reward.path (a Python identifier), e.g. compute_score"),
    # ---- model
    ints("model.context_len", 1, "max positions the engines and trainers may use"),
    choice("model.dtype", ("float32", "bfloat16", "float16"), "use float32 (CPU), bfloat16 or float16"),
    ints("model.hidden_size", 1),
    ints("model.num_layers", 1),
    ints("model.num_heads", 1),
    ints("model.intermediate_size", 1),
    ints("model.warmup_steps", 0, "supervised warm-start steps; 0 = none"),
    text("model.cache_dir", "where the tiny model is built"),
    text("model.name_or_path", "a checkpoint directory or a hub id"),
    # ---- algo (loss_agg, kl_placement, kl_estimator, overlong_buffer: `_algorithm`)
    *(ints(f"algo.{k}", 1) for k in ("num_steps", "rollout_batch_size", "samples_per_prompt", "train_batch_size",
                                     "micro_batch_size", "ppo_epochs")),
    reals("algo.actor_lr", 0, why="learning rate"),
    reals("algo.critic_lr", 0, why="learning rate"),
    reals("algo.temperature", 0, 2, lo_open=True, why="policy-gradient methods need sampled responses; vLLM takes at most 2"),
    reals("algo.grad_clip", 0, why="gradient-norm clipping; 0 = off"),
    *(reals(f"algo.{k}", 0, 1, lo_open=True, hi_open=True, why="typically 0.2 (DAPO: clip_high 0.28)")
      for k in ("clip_low", "clip_high")),
    Range("algo.clip_ratio_c", lambda v: v is None or (_is_real(v) and v > 1),
          "null (off) or > 1, the dual-clip bound on a negative advantage's loss (veRL, OpenRLHF: 3)", nullable=True),
    ints("algo.loss_agg_norm_len", 0, "0 = data.response_max_len"),
    reals("algo.entropy_coef", 0),
    Range("algo.tis_cap", lambda v: v is None or (_is_real(v) and v >= 1),
          "null (off) or >= 1, the largest importance weight a token gets (typically 2)"),
    reals("algo.kl_coef", 0),
    reals("algo.gamma", 0, 1, why="discount factor"),
    reals("algo.lam", 0, 1, why="GAE lambda"),
    reals("algo.value_clip_eps", 0, lo_open=True, why="typically 0.2"),
    reals("algo.eps", 0, lo_open=True, why="added to the group std before dividing; typically 1e-6"),
    ints("algo.max_gen_batches", 1, "rollout rounds per step"),
    reals("algo.overlong_penalty", 0, why="the size of DAPO's overlong penalty; a negative one would reward overlong answers"),
    # ---- eval
    ints("eval.every_n_steps", 0, "0 = off"),
    ints("eval.num_prompts", 0, "0 = the whole validation set"),
    ints("eval.samples_per_prompt", 1, "the k of mean@k and pass@k"),
    reals("eval.temperature", 0, why="0 = greedy"),
    reals("eval.pass_threshold", why="a sample passes when its score reaches it"),
    # ---- trainer
    choice("trainer.zero_stage", (0, 1, 2, 3), "DeepSpeed ZeRO stages are 0, 1, 2 or 3"),
    reals("trainer.weight_decay", 0, why="weight decay, typically 0-0.1"),
    choice("trainer.optimizer", ("adamw", "sgd"), "use 'adamw' (the default) or 'sgd' (plain, no momentum)"),
    ints("trainer.seed", 0, _SEED_WHY, hi=_SEED_MAX),
    # ---- engine
    reals("engine.kv_cache_gb", 0, lo_open=True, why="GiB of KV cache per CPU engine", when=_gpu_layout),
    Range("engine.kv_cache_gb", lambda v: _is_real(v) and v >= 1 and float(v).is_integer(),
          "must be a whole number of GiB >= 1 (vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE in whole GiB)",
          when=lambda c: not _gpu_layout(c)),
    reals("engine.gpu_memory_utilization", 0, 1, lo_open=True, why="the fraction of each GPU's memory vLLM may take",
          nullable=True),
    ints("engine.sleep_level", 0, "vLLM's sleep levels: 0 off, 1 weights to CPU, 2 weights dropped", hi=2, nullable=True),
    # ---- checkpoint
    ints("checkpoint.every_n_steps", 0, "0 = only at the end of the run and on signals"),
    ints("checkpoint.keep_last", 1, "complete checkpoints kept"),
    text("checkpoint.dir", "null = <run dir>/checkpoints", nullable=True),
    # ---- fault
    ints("fault.max_engine_restarts", 0, "0 = no engine restarts"),
    reals("fault.step_timeout_s", 0, lo_open=True, why="seconds any wait on an actor within a step may take"),
    # ---- logger
    ints("logger.plot_every_n_steps", 0, "0 = plots only at the end of the run"),
    Range("logger.project", lambda v: isinstance(v, str) and v.strip() != "" and len(v) <= 128
          and not any(ch in v for ch in _WANDB_BAD_CHARS),
          f"W&B project names are 1-128 characters without any of {_WANDB_BAD_CHARS}",
          when=lambda c: isinstance(c.logger, WandbLoggerConfig)),
    choice("logger.mode", ("online", "offline", "disabled", "shared"),
           "use online, offline or disabled (or null: online with WANDB_API_KEY, else offline)", nullable=True,
           when=lambda c: isinstance(c.logger, WandbLoggerConfig)),
    text("logger.entity", "a W&B user or team, or null for the default", nullable=True,
         when=lambda c: isinstance(c.logger, WandbLoggerConfig)),
    # ---- launcher
    ints("launcher.logical_gpus", 0, "0 = only real GPUs"),
    ints("launcher.num_cpus", 1, "logical CPUs for Ray; null = the default", nullable=True),
    reals("launcher.startup_timeout_s", 0, lo_open=True, why="seconds actors and placement groups may take to start"),
    # ---- root
    ints("seed", 0, _SEED_WHY, hi=_SEED_MAX),
    Range("experiment_name", lambda v: isinstance(v, str) and v.strip() not in ("", ".", "..") and "/" not in v
          and "\\" not in v, "must be a non-empty name without '/' (it names the run's directory under outputs/)"),
)


def _lookup(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, _ABSENT)
        if node is _ABSENT:
            return _ABSENT
    return node


def _ranges(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    return range_problems(cfg)


def validate_values(cfg: RootConfig) -> None:
    """`RANGES` alone: needs no plan, so a caller can run it before the planner and the group
    constructors (which stop at the first bad value) to list every bad value at once."""
    problems = range_problems(cfg)
    if problems:
        raise ConfigError(problems)


def range_problems(cfg: RootConfig) -> list[Problem]:
    problems = []
    for r in RANGES:
        value = _lookup(cfg, r.key)
        if value is _ABSENT or (value is None and r.nullable):
            continue
        if r.when is not None and not r.when(cfg):
            continue
        if not r.ok(value):
            problems.append(Problem(r.key, value, r.fix))
    return problems


# =========================================================================== relations between keys
def _batch_sizes(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    a = cfg.algo
    problems = []
    if min(a.rollout_batch_size, a.samples_per_prompt, a.train_batch_size, a.micro_batch_size) < 1:
        return []  # reported by _ranges; the arithmetic below needs positive sizes
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
    if sync.needs_colocated_engines and plan.layout == "colocated":
        from rlhf_orch.topology.plan import ipc_feeds, unfed_ipc_workers

        missing = unfed_ipc_workers(ipc_feeds(plan))
        if missing:
            where = ", ".join(f"engine{f.engine}/tp{f.tp_rank} on node {f.node} GPU {f.bundle}" for f in missing)
            problems.append(
                Problem("placement.actor_ranks", cfg.placement.actor_ranks,
                        f"CUDA IPC opens memory of the same GPU only, and no policy rank sits on {where}: raise "
                        "placement.actor_ranks so every engine GPU has one, or use sync=nccl_bucketed")
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


def _engine_memory(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    level = cfg.engine.sleep_level
    if _is_int(level) and level > 0 and plan.total_gpus == 0:
        return [Problem("engine.sleep_level", level, "vLLM's sleep mode frees GPU memory and needs a GPU layout; "
                        "use 0 (or null) with placement=cpu_local")]
    return []


def _algorithm(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    from rlhf_orch.algo.losses import KL_DIVERGENCE_ESTIMATORS, LOSS_AGGREGATIONS

    a = cfg.algo
    problems = []
    if a.loss_agg not in LOSS_AGGREGATIONS:
        problems.append(Problem("algo.loss_agg", a.loss_agg, f"use one of {', '.join(LOSS_AGGREGATIONS)}"))
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
    if a.compares_group_samples and a.samples_per_prompt < 2:
        problems.append(
            Problem(
                "algo.samples_per_prompt",
                a.samples_per_prompt,
                "this algorithm compares the samples of one prompt (a group of one has advantage 0 and "
                "trains on nothing): use >= 2 (typically 4-16)",
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
    if getattr(a, "overlong_buffer", 0) < 0 or getattr(a, "overlong_buffer", 0) >= cfg.data.response_max_len > 0:
        problems.append(
            Problem("algo.overlong_buffer", a.overlong_buffer, f"must be in [0, data.response_max_len={cfg.data.response_max_len})")
        )
    return problems


def _roles(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    needed = ["actor", "engine"] + ["critic"] * cfg.algo.needs_critic + ["reference"] * cfg.algo.needs_reference
    for role in needed:
        if not plan.slots_for(role):
            problems.append(Problem(f"placement ({plan.layout})", f"no {role}", f"the plan must place at least one {role}"))
    return problems


def _transfer(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """The packed token budget vs sequence length."""
    t, d, a = cfg.transfer, cfg.data, cfg.algo
    longest = d.prompt_max_len + d.response_max_len
    if t.token_budget < 0:
        return [Problem("transfer.token_budget", t.token_budget, f"must be >= 0; 0 derives algo.micro_batch_size x {longest}")]
    if 0 < t.token_budget < longest:
        return [
            Problem(
                "transfer.token_budget",
                t.token_budget,
                f"a sequence can be data.prompt_max_len + data.response_max_len = {longest} tokens and must fit one "
                f"micro-batch; set transfer.token_budget >= {longest} (or 0 to derive {a.micro_batch_size} x {longest})",
            )
        ]
    return []


def _pipeline(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """An overlapping pipeline holds a finished rollout until the trainers are free: ask the
    chosen pipeline and transfer classes what they need and can do."""
    pipeline, transfer = get_class(cfg.pipeline._target_), get_class(cfg.transfer._target_)
    if pipeline.needs_held_rollouts and not transfer.holds_rollouts:
        return [
            Problem(
                "transfer",
                cfg.transfer._target_.rsplit(".", 1)[-1],
                "this pipeline generates the next rollout while the trainers train, so the rollout must wait on the "
                "engines until they are free; a streaming transfer hands it to them during generation: "
                "use transfer=packed (or padded), or pipeline=sync",
            )
        ]
    return []


def _evaluation(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    e, d = cfg.eval, cfg.data
    problems = []
    if e.temperature == 0 and e.samples_per_prompt > 1:
        problems.append(
            Problem(
                "eval.samples_per_prompt",
                e.samples_per_prompt,
                "greedy decoding (eval.temperature=0) gives k identical samples; set eval.temperature > 0 "
                "(e.g. 0.6) for pass@k with k > 1, or eval.samples_per_prompt=1",
            )
        )
    if e.every_n_steps or e.before_train:
        if isinstance(d, DigitTaskConfig) and d.eval_size == 0:
            problems.append(
                Problem("data.eval_size", 0, "evaluation is on (eval.every_n_steps/eval.before_train) but there are no "
                        "held-out prompts: set data.eval_size > 0 (e.g. 64) or turn evaluation off")
            )
        elif isinstance(d, FilesDataConfig) and not d.val_files:
            problems.append(
                Problem("data.val_files", [], "evaluation is on (eval.every_n_steps/eval.before_train) but there is no "
                        "validation set: set data.val_files=[...] or eval.every_n_steps=0 eval.before_train=false")
            )
    scores = _rule_score_range(cfg)
    if scores is not None and _is_real(e.pass_threshold):
        lo, hi = scores
        if e.pass_threshold > hi:
            problems.append(
                Problem("eval.pass_threshold", e.pass_threshold, f"the reward scores at most {hi:g}, so no sample could "
                        f"pass (pass@k always 0); use a threshold in ({lo:g}, {hi:g}], e.g. {hi:g}")
            )
        elif e.pass_threshold <= lo:
            problems.append(
                Problem("eval.pass_threshold", e.pass_threshold, f"the reward scores at least {lo:g}, so every sample "
                        f"would pass (pass@k always 1); use a threshold in ({lo:g}, {hi:g}], e.g. {hi:g}")
            )
    return problems


def _rule_score_range(cfg: RootConfig) -> Optional[tuple[float, float]]:
    """(lowest, highest) score of the rule rewards whose scores are known; None otherwise."""
    r = cfg.reward
    if isinstance(r, (DigitRuleConfig, MathVerifyRuleConfig)):
        return 0.0, 1.0
    if isinstance(r, (GSM8KRuleConfig, CountdownRuleConfig)) and _is_real(r.score) and _is_real(r.format_score):
        values = (0.0, float(r.format_score), float(r.score))
        return min(values), max(values)
    return None  # a user's function or a reward model: any real number


def _is_local_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(("/", "./", "../", "~"))


def _model_source(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    path = getattr(cfg.model, "name_or_path", None)
    if _is_local_path(path) and not Path(path).expanduser().exists():
        problems.append(Problem("model.name_or_path", path, "no such directory; give an existing checkpoint directory or a hub id"))
    m = cfg.model
    if isinstance(m, TinyModelConfig) and m.num_heads >= 1 and m.hidden_size >= 1:
        if m.hidden_size % m.num_heads:
            problems.append(
                Problem("model.num_heads", m.num_heads, f"must divide model.hidden_size={m.hidden_size} "
                        f"(head_dim = hidden_size / num_heads); e.g. num_heads={max(1, m.hidden_size // _TINY_MIN_HEAD_DIM)}")
            )
        elif m.hidden_size // m.num_heads < _TINY_MIN_HEAD_DIM:
            problems.append(
                Problem("model.num_heads", m.num_heads, f"head_dim = model.hidden_size / num_heads = "
                        f"{m.hidden_size // m.num_heads} < {_TINY_MIN_HEAD_DIM}, which vLLM's CPU attention refuses; use "
                        f"num_heads <= {max(1, m.hidden_size // _TINY_MIN_HEAD_DIM)} or a larger hidden_size")
            )
        need = _tiny_min_vocab()
        if m.vocab_size < need:
            problems.append(
                Problem("model.vocab_size", m.vocab_size, f"the tiny tokenizer needs >= {need} tokens (4 special tokens, "
                        "the task's characters and one token per task word); use e.g. 64")
            )
    return problems


# vLLM's CPU attention kernels reject smaller heads (rlhf_orch.models.tiny_build.MIN_HEAD_DIM, not
# imported: that module pulls in transformers, and checks must stay fast).
_TINY_MIN_HEAD_DIM = 32
_TINY_SPECIAL_TOKENS = 4  # tiny_build.SPECIAL_TOKENS: pad, bos, eos, unk


def _tiny_min_vocab() -> int:
    """Smallest BPE vocabulary holding every task word as one token (as tiny_build trains it)."""
    from rlhf_orch.data.digit_task import DigitReverseTask

    words = DigitReverseTask.vocabulary_words()
    alphabet = {"▁"} | {ch for w in words for ch in w}  # Metaspace marks each word start with "▁"
    merges = sum(len(w) for w in words)  # "▁" + n characters -> one token takes n merges
    return _TINY_SPECIAL_TOKENS + len(alphabet) + merges


def _placement(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """Relations between placement keys (the planner refuses most of them first, one at a time)."""
    p = cfg.placement
    problems = []
    if isinstance(p, CpuLocalPlacementConfig) or p.engine_tp < 1 or p.gpus_per_node < 1 or p.nodes < 1:
        return problems
    if p.gpus_per_node % p.engine_tp:
        problems.append(
            Problem("placement.engine_tp", p.engine_tp, f"must divide placement.gpus_per_node={p.gpus_per_node}, "
                    "or an engine's tensor-parallel GPUs would straddle two nodes")
        )
    capacity = p.nodes * p.gpus_per_node
    if isinstance(p, ColocatedPlacementConfig):
        roles = {"actor": p.actor_fraction, "engine": p.engine_fraction}
        if cfg.algo.needs_critic:
            roles["critic"] = p.critic_fraction
        if cfg.algo.needs_reference:
            roles["reference"] = p.reference_fraction
        if isinstance(cfg.reward, ModelRewardConfig):
            roles["reward"] = p.reference_fraction  # a reward model claims the reference's share
        if all(_is_real(v) for v in roles.values()) and sum(roles.values()) > 1 + 1e-9:
            keys = sorted({"reference" if r == "reward" else r for r in roles})
            problems.append(
                Problem("+".join(f"placement.{k}_fraction" for k in keys), round(sum(roles.values()), 6),
                        f"every role ({', '.join(roles)}) shares GPU 0, so their fractions must sum to <= 1; lower them")
            )
        util = cfg.engine.gpu_memory_utilization
        if _is_real(util) and _is_real(p.engine_fraction) and util > p.engine_fraction + 1e-9:
            problems.append(
                Problem("engine.gpu_memory_utilization", util,
                        "on a colocated GPU vLLM reserves this fraction of the WHOLE GPU's memory at start, more than "
                        f"the engine's planned share placement.engine_fraction={p.engine_fraction:g}; the trainer "
                        "processes sharing the GPU need the rest: lower it to <= engine_fraction (or leave it null "
                        "to use engine_fraction), or raise placement.engine_fraction and lower the others")
            )
        placed = ("actor_ranks",) + ("critic_ranks",) * cfg.algo.needs_critic + ("reference_ranks",) * cfg.algo.needs_reference
        for key in placed:  # the planner gives a role the algorithm does not use no ranks
            ranks = getattr(p, key)
            if ranks > capacity:
                problems.append(Problem(f"placement.{key}", ranks, f"colocated ranks sit one per GPU: use <= {capacity} "
                                        f"(placement.nodes x placement.gpus_per_node) or add nodes/GPUs"))
        if p.engines * p.engine_tp > capacity:
            problems.append(Problem("placement.engines", p.engines, f"engines x engine_tp = {p.engines * p.engine_tp} GPUs "
                                    f"exceed the {capacity} of placement.nodes x placement.gpus_per_node: use <= "
                                    f"{capacity // p.engine_tp} engines or add nodes/GPUs"))
    if isinstance(p, SplitPlacementConfig) and p.ratio is None:
        critic = p.critic_gpus if cfg.algo.needs_critic else 0
        if p.actor_gpus + p.critic_gpus + p.vllm_gpus > capacity and min(p.actor_gpus, p.critic_gpus, p.vllm_gpus) >= 0:
            problems.append(
                Problem("placement.vllm_gpus", p.vllm_gpus, f"actor_gpus + critic_gpus + vllm_gpus = "
                        f"{p.actor_gpus + p.critic_gpus + p.vllm_gpus} exceed the {capacity} GPUs of placement.nodes x "
                        "placement.gpus_per_node: lower the per-role GPUs or add nodes/GPUs")
            )
        vllm = p.vllm_gpus + (p.critic_gpus - critic)  # a critic-free algorithm gives the critic's GPUs to vLLM
        if vllm >= 1 and vllm % p.engine_tp:
            problems.append(
                Problem("placement.vllm_gpus", p.vllm_gpus, f"vLLM gets {vllm} GPUs, not a multiple of "
                        f"placement.engine_tp={p.engine_tp}: make it one")
            )
    return problems


def _data(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    d = cfg.data
    problems = []
    sizes_ok = min(d.prompt_max_len, d.response_max_len) >= 1 and getattr(d, "filler_tokens", 0) >= 0
    if isinstance(d, DigitTaskConfig) and sizes_ok:  # (bad sizes themselves: `_ranges`)
        if d.min_digits > d.max_digits:
            problems.append(Problem("data.min_digits", d.min_digits, f"must be <= data.max_digits={d.max_digits}"))
        prompt_tokens = 1 + d.filler_tokens + 1 + d.max_digits + 1  # BOS, filler, "rev", digits, "="
        if prompt_tokens > d.prompt_max_len:
            problems.append(
                Problem("data.prompt_max_len", d.prompt_max_len, f"prompts take up to {prompt_tokens} tokens (BOS + "
                        f"data.filler_tokens={d.filler_tokens} + rev + data.max_digits={d.max_digits} + =): raise it to "
                        f">= {prompt_tokens} or lower filler_tokens/max_digits")
            )
        if d.max_digits + 1 > d.response_max_len:
            problems.append(
                Problem("data.response_max_len", d.response_max_len, f"the answer takes up to {d.max_digits + 1} tokens "
                        f"(data.max_digits={d.max_digits} + EOS): raise it to >= {d.max_digits + 1}")
            )
    if isinstance(d, FilesDataConfig):
        from rlhf_orch.data.base import DataError
        from rlhf_orch.data.files import DEFAULT_LABEL_KEY, PromptDataset

        try:
            PromptDataset._check_template(d.prompt_template, d.prompt_key)
        except DataError as e:
            problems.append(Problem("data.prompt_template", d.prompt_template, str(e).split(": ", 1)[-1]))
        if d.label_columns is not None:
            if d.label_key is not None and d.label_key != DEFAULT_LABEL_KEY:
                problems.append(Problem("data.label_key", d.label_key, "data.label_columns gives the label; set "
                                        "data.label_key=null (or data.label_columns=null)"))
            if d.label_regex is not None:
                problems.append(Problem("data.label_regex", d.label_regex, "applies to data.label_key only; remove it "
                                        "or set data.label_columns=null"))
        if d.label_regex is not None:
            try:
                re.compile(d.label_regex)
            except re.error as e:
                problems.append(Problem("data.label_regex", d.label_regex, f"not a regular expression ({e})"))
    return problems


def _reward(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    r = cfg.reward
    problems = []
    if isinstance(r, (GSM8KRuleConfig, CountdownRuleConfig)) and _is_real(r.score) and _is_real(r.format_score):
        if r.score <= r.format_score:
            problems.append(
                Problem("reward.score", r.score, f"a correct answer must score more than a wrong one "
                        f"(reward.format_score={r.format_score:g}): use e.g. reward.score=1.0")
            )
    if isinstance(r, ModelRewardConfig):
        rule_weight = r.rule_weight if r.rule is not None else 0
        if r.weight == 0 and rule_weight == 0:
            problems.append(
                Problem("reward.weight", r.weight, "with no rule (or reward.rule_weight=0) every score would be 0: "
                        "use a weight != 0 (e.g. 1.0)")
            )
        if _is_local_path(r.model_path) and not Path(r.model_path).expanduser().exists():
            problems.append(Problem("reward.model_path", r.model_path, "no such directory; give an existing "
                                    "sequence-classification checkpoint, a hub id, or null (the tiny one)"))
    return problems


def _timeouts(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """A shorter outer timeout makes an inner one unreachable."""
    step = _lookup(cfg, "fault.step_timeout_s")
    if not _is_real(step) or step <= 0:
        return []
    problems = []
    if _is_real(cfg.sync.timeout_s) and cfg.sync.timeout_s > step:
        problems.append(
            Problem("fault.step_timeout_s", step, f"a step waits on the weight sync, so sync.timeout_s="
                    f"{cfg.sync.timeout_s:g} could never fire: use fault.step_timeout_s >= {cfg.sync.timeout_s:g} "
                    "(or a lower sync.timeout_s)")
        )
    if _is_real(cfg.reward.timeout_s) and cfg.reward.timeout_s > step:
        problems.append(
            Problem("reward.timeout_s", cfg.reward.timeout_s, f"one sample's scoring limit exceeds "
                    f"fault.step_timeout_s={step:g}, the limit of the whole step: use less (typical 10)")
        )
    return problems


def _launcher(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    lc = cfg.launcher
    problems = []
    if isinstance(lc, ClusterLauncherConfig):
        if lc.logical_gpus:
            problems.append(Problem("launcher.logical_gpus", lc.logical_gpus, "cannot be applied to a running cluster: "
                                    "give `ray start --num-gpus=N` on each node, or use launcher=local"))
        if lc.num_cpus is not None:
            problems.append(Problem("launcher.num_cpus", lc.num_cpus, "cannot be applied to a running cluster: "
                                    "give `ray start --num-cpus=N` on each node, or use launcher=local"))
    elif isinstance(lc, LocalLauncherConfig):
        if lc.address not in (None, "local"):
            problems.append(Problem("launcher.address", lc.address, "launcher=local starts its own Ray; to join a "
                                    "cluster use launcher=cluster launcher.address=..., else leave address null"))
        if not lc.dry_run and (lc.num_cpus is None or lc.num_cpus >= 1):
            cpus = lc.num_cpus if lc.num_cpus is not None else _default_logical_cpus()
            if cpus is not None and plan.total_cpus > cpus:
                need = math.ceil(plan.total_cpus)
                problems.append(
                    Problem("launcher.num_cpus", lc.num_cpus, f"the {plan.layout} plan reserves {plan.total_cpus:g} "
                            f"logical CPUs (one per process) but Ray would offer {cpus}, so its placement groups "
                            f"could never start: set launcher.num_cpus={need} (or more)")
                )
    return problems


def _default_logical_cpus() -> Optional[int]:
    try:
        from launchers.local import MIN_LOGICAL_CPUS
    except ImportError:  # launchers/ is not importable from here: no check
        return None
    return max(os.cpu_count() or 1, MIN_LOGICAL_CPUS)


def _paths(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    resume = _lookup(cfg, "resume")
    if isinstance(resume, str) and resume != "auto" and not Path(resume).expanduser().exists():
        problems.append(Problem("resume", resume, "no such run or checkpoint directory; give an existing one, "
                                "'auto' (the latest checkpoint of this experiment_name) or null"))
    ckpt = _lookup(cfg, "checkpoint.dir")
    if isinstance(ckpt, str) and ckpt.strip() and Path(ckpt).expanduser().exists() and not Path(ckpt).expanduser().is_dir():
        problems.append(Problem("checkpoint.dir", ckpt, "is a file, not a directory; give a directory shared by every "
                                "node (or null for <run dir>/checkpoints)"))
    return problems


CHECKS: tuple[Callable[[RootConfig, PlacementPlan, Hardware], list[Problem]], ...] = (
    _ranges,
    _batch_sizes,
    _gpus,
    _lengths,
    _sync_backend,
    _engine_memory,
    _algorithm,
    _roles,
    _model_source,
    _transfer,
    _pipeline,
    _evaluation,
    _placement,
    _data,
    _reward,
    _timeouts,
    _launcher,
    _paths,
)


def validate(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> None:
    problems = [p for check in CHECKS for p in check(cfg, plan, hw)]
    if problems:
        raise ConfigError(problems)


# =========================================================================== the run directory
def check_run_dir_writable(path: Path) -> None:
    """Refuse a run dir that cannot be created, or in which a small file cannot be written and deleted."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rlhf_orch_write_check_", dir=path)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)  # a full disk may only say so here
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            [Problem("hydra.run.dir", str(path), f"cannot write there ({reason}); give a writable directory, "
                     "e.g. hydra.run.dir=/tmp/rlhf_orch/run")]
        ) from e
