"""The valid range of every single key: one row of `RANGES` each (key path, predicate, fix),
evaluated over the typed config; a row whose key the chosen group option does not have is skipped.
Needs no plan: `validate_values` lists every bad value before the planner and the group
constructors (which stop at the first) run. Checks between keys: rlhf_orch.config.validate.
"""

from __future__ import annotations

import math
import re
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlhf_orch.config.problems import ConfigError, Problem
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.logging.options import WandbLoggerConfig
from rlhf_orch.reward.options import GSM8KRuleConfig
from rlhf_orch.topology.options import ColocatedPlacementConfig, CpuLocalPlacementConfig, SplitPlacementConfig
from rlhf_orch.models.lora import ALL_LINEAR, SYNC_MODES, VLLM_MAX_LORA_RANKS
from rlhf_orch.trainer.options import OLD_LOGPROBS_MODES

_ABSENT = object()


@dataclass(frozen=True)
class Range:
    """One key's valid values: `ok(value)` must hold, else `Problem(key, value, fix)`."""

    key: str  # dotted path in RootConfig; skipped when the chosen option has no such field
    ok: Callable[[Any], bool]
    fix: str
    when: Optional[Callable[[RootConfig], bool]] = None  # the row applies only when this holds
    nullable: bool = False  # None is a valid value (the key's "off"/"derive" setting)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def ints(key: str, lo: int, why: str = "", hi: Optional[int] = None, **kw: Any) -> Range:
    bound = f"must be >= {lo}" if hi is None else f"must be in [{lo}, {hi}]"
    return Range(key, lambda v: is_int(v) and v >= lo and (hi is None or v <= hi), bound + _why(why), **kw)


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
        if not is_real(v):
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


def _lora_targets_ok(v: Any) -> bool:
    if isinstance(v, str):  # any other string would be a PEFT regex the engines and the plan cannot follow
        return v == ALL_LINEAR
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(m, str) and m.strip() for m in v)


def _needs_critic(c: RootConfig) -> bool:
    return c.algo.needs_critic


def _has_reference_ranks(c: RootConfig) -> bool:
    """Reference ranks are placed: they hold the KL reference and the teacher."""
    return c.algo.needs_reference_ranks


def _ranked(c: RootConfig) -> bool:
    """The layout reads rank and engine counts (split derives them from its GPU counts)."""
    return not isinstance(c.placement, SplitPlacementConfig)


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
    ints("placement.actor_ranks", 1, "the policy needs at least one rank", when=_ranked),
    ints("placement.critic_ranks", 1, "this algorithm has a critic", when=lambda c: _ranked(c) and _needs_critic(c)),
    ints("placement.critic_ranks", 0, "unused without a critic", when=lambda c: _ranked(c) and not c.algo.needs_critic),
    ints(
        "placement.reference_ranks",
        1,
        "the KL term and the teacher need a reference rank",
        when=lambda c: _ranked(c) and _has_reference_ranks(c),
    ),
    ints(
        "placement.reference_ranks",
        0,
        "unused without a KL term or a teacher",
        when=lambda c: _ranked(c) and not _has_reference_ranks(c),
    ),
    ints("placement.engines", 1, "rollouts need at least one vLLM engine", when=_ranked),
    *(
        Range(
            f"placement.{key}",
            lambda v: v is None,
            f"placement=split derives it from the GPU counts ({how}): leave it null and set {gpus}",
            when=lambda c: not _ranked(c),
        )
        for key, how, gpus in (
            ("actor_ranks", "one policy rank per actor GPU", "placement.actor_gpus"),
            ("critic_ranks", "one critic rank per critic GPU", "placement.critic_gpus"),
            ("reference_ranks", "one reference beside each policy rank", "placement.actor_gpus"),
            ("engines", "one engine per placement.engine_tp vLLM GPUs", "placement.vllm_gpus"),
        )
    ),
    ints("placement.engine_tp", 1, "GPUs (CPU workers) per engine"),
    ints("placement.nodes", 1, "plan at least one node", when=_gpu_layout),
    ints(
        "placement.gpus_per_node", 1, "GPU layouts need GPUs; use placement=cpu_local on CPU machines", when=_gpu_layout
    ),
    Range(
        "placement.nodes",
        lambda v: v == 1,
        "placement=cpu_local runs everything on this machine: set placement.nodes=1",
        when=lambda c: isinstance(c.placement, CpuLocalPlacementConfig),
    ),
    Range(
        "placement.gpus_per_node",
        lambda v: v == 0,
        "placement=cpu_local uses no GPUs: set placement.gpus_per_node=0",
        when=lambda c: isinstance(c.placement, CpuLocalPlacementConfig),
    ),
    *(
        reals(
            f"placement.{k}_fraction",
            0,
            1,
            lo_open=True,
            why="a role's share of one GPU, e.g. 0.25",
            when=lambda c: isinstance(c.placement, ColocatedPlacementConfig),
        )
        for k in ("actor", "critic", "reference", "engine")
    ),
    reals(
        "placement.reference_fraction",
        0,
        1,
        lo_open=True,
        hi_open=True,
        why="the reference's share of each actor GPU; the actor keeps the rest",
        when=lambda c: isinstance(c.placement, SplitPlacementConfig),
    ),
    Range(
        "placement.ratio",
        _ratio_ok,
        "write it 'trainer:vllm' with two positive integers, e.g. '3:1', or null "
        "to give actor_gpus/critic_gpus/vllm_gpus",
        nullable=True,
    ),
    ints("placement.actor_gpus", 1, "the actor needs at least one GPU"),
    ints("placement.critic_gpus", 1, "the critic needs at least one GPU", when=_needs_critic),
    ints(
        "placement.critic_gpus", 0, "without a critic these GPUs join vllm_gpus", when=lambda c: not c.algo.needs_critic
    ),
    ints("placement.vllm_gpus", 1, "vLLM needs at least one GPU"),
    # ---- transfer
    ints("transfer.max_in_flight", 1, "micro-batches handed over but not yet staged; typical 2-8"),
    ints(
        "pipeline.max_staleness",
        0,
        hi=64,
        why="weight versions a sequence may lag behind the trainers; typical 1-4 (0 = sync)",
    ),
    # transfer.token_budget: `checks_shapes.transfer` (its fix names the sequence length)
    # ---- sync (backend: `checks_run.sync_backend`, it depends on the strategy and the hardware)
    reals("sync.timeout_s", 0, lo_open=True, why="seconds one weight sync may take"),
    reals("checkpoint.timeout_s", 0, lo_open=True, why="seconds writing one checkpoint or export may take"),
    reals("sync.bucket_mb", 0, lo_open=True, why="typical: 64-1024"),
    ints("sync.senders", 1, "policy ranks that send at once"),
    choice("sync.shard_by", ("buckets", "engines"), "use 'buckets' (each sender a share of the buckets) or 'engines'"),
    # ---- data
    ints("data.prompt_max_len", 1, "tokens"),
    ints("data.response_max_len", 1, "tokens"),
    ints("data.seed", 0, _SEED_WHY, hi=_SEED_MAX),
    ints("data.min_digits", 1, "digits of the shortest task"),
    reals("data.long_tail_frac", 0, 1, why="fraction of prompts answered at length; typical 0.05"),
    ints("data.long_tail_len", 0, "tokens a long-tail response runs at least (<= data.response_max_len)"),
    ints("data.max_digits", 1, "digits of the longest task"),
    ints("data.filler_tokens", 0, "extra context tokens in front of the task"),
    ints("data.eval_size", 0, "held-out prompts; 0 = none"),
    text("data.task", "a reasoning-gym dataset name, e.g. basic_arithmetic"),
    ints("data.size", 1, "training entries of the reasoning-gym dataset"),
    ints("data.few_shot", 0, "solved examples before each question; 0 = none", hi=16),
    text(
        "data.system_prompt",
        "a reasoning-gym system prompt name (default, direct, ...), your text, or null",
        nullable=True,
    ),
    Range(
        "data.train_files",
        _files_ok,
        "give at least one file: data.train_files=[/path/train.parquet] "
        "(.parquet, .jsonl, .json or hf:<name>[:<config>]@<split>)",
    ),
    Range(
        "data.val_files",
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(f, str) and f.strip() for f in v),
        "must be a list of file names (empty: no validation set)",
    ),
    choice(
        "data.overlong",
        ("error", "filter"),
        "use 'error' (stop on a prompt longer than data.prompt_max_len) or 'filter' (drop it)",
    ),
    text("data.prompt_key", "a column name, or null with data.prompt_template", nullable=True),
    text("data.label_key", "a column name (dots read nested fields), or null", nullable=True),
    text("data.source_key", "the column naming each row's data source"),
    text("data.extra_key", "the column with extra per-row information"),
    text("data.default_source", "the source name of rows without one; it names the eval/<source>/ metrics"),
    Range("data.label_columns", _columns_ok, "must be a non-empty list of column names, or null", nullable=True),
    # ---- reward
    reals("reward.timeout_s", 0, lo_open=True, why="seconds one sample may take to score"),
    ints("reward.pool_size", 0, "0 scores inline on the engines, N in N Ray tasks"),
    choice(
        "reward.method",
        ("strict", "flexible"),
        "use 'strict' (the number after ####) or 'flexible' (the last number)",
        when=lambda c: isinstance(c.reward, GSM8KRuleConfig),
    ),
    reals("reward.format_score"),
    reals("reward.score"),
    reals("reward.weight", why="multiplies the reward model's score"),
    reals("reward.rule_weight", why="multiplies the rule's score"),
    ints("reward.micro_batch_size", 1, "sequences per reward-model forward pass"),
    Range(
        "reward.name",
        lambda v: isinstance(v, str) and v.isidentifier(),
        "must be the name of the function in reward.path (a Python identifier), e.g. compute_score",
    ),
    # ---- model
    ints("model.context_len", 1, "max positions the engines and trainers may use"),
    ints(
        "model.layers",
        1,
        "decoder layers a packaged model's student keeps (the first ones); null = the whole model",
        nullable=True,
        when=lambda c: hasattr(c.model, "gguf_file"),
    ),
    ints("model.lora.rank", 0, "LoRA adapter rank; 0 = full fine-tuning", hi=VLLM_MAX_LORA_RANKS[-1]),
    reals(
        "model.lora.alpha",
        0,
        lo_open=True,
        why="the adapter's update is alpha / rank * B @ A; null = 4 x rank",
        nullable=True,
    ),
    reals("model.lora.dropout", 0, 1, hi_open=True, why="dropout on the adapters' input while training"),
    choice("model.lora.sync", SYNC_MODES),
    Range(
        "model.lora.target_modules",
        _lora_targets_ok,
        f'give "{ALL_LINEAR}" or a non-empty list of module names (q_proj, v_proj, ...)',
    ),
    choice("model.dtype", ("float32", "bfloat16", "float16"), "use float32 (CPU), bfloat16 or float16"),
    ints("model.hidden_size", 1),
    ints("model.num_layers", 1),
    ints("model.num_heads", 1),
    ints("model.intermediate_size", 1),
    ints("model.warmup_steps", 0, "supervised warm-start steps; 0 = none"),
    text("model.cache_dir", "where a locally built model (tiny, packaged) is cached"),
    text("model.distribution", "the package that ships the model file (pip name)"),
    text("model.version", "the package's pinned version"),
    text("model.gguf_file", "the GGUF file's path inside the package"),
    text("model.name_or_path", "a checkpoint directory or a hub id"),
    # ---- algo (loss_agg, kl_placement, kl_estimator, overlong_buffer: `checks_algo.algorithm`)
    *(
        ints(f"algo.{k}", 1)
        for k in (
            "num_steps",
            "rollout_batch_size",
            "samples_per_prompt",
            "train_batch_size",
            "micro_batch_size",
            "ppo_epochs",
        )
    ),
    reals("algo.actor_lr", 0, why="learning rate"),
    reals("algo.critic_lr", 0, why="learning rate"),
    reals(
        "algo.temperature",
        0,
        2,
        lo_open=True,
        why="policy-gradient methods need sampled responses; vLLM takes at most 2",
    ),
    ints("algo.min_response_len", 0, "tokens every response has at least (EOS suppressed until then); 0 = off"),
    reals("algo.grad_clip", 0, why="gradient-norm clipping; 0 = off"),
    *(
        reals(f"algo.{k}", 0, 1, lo_open=True, hi_open=True, why="typically 0.2 (DAPO: clip_high 0.28)")
        for k in ("clip_low", "clip_high")
    ),
    Range(
        "algo.clip_ratio_c",
        lambda v: v is None or (is_real(v) and v > 1),
        "null (off) or > 1, the dual-clip bound on a negative advantage's loss (veRL, OpenRLHF: 3)",
        nullable=True,
    ),
    ints("algo.loss_agg_norm_len", 0, "0 = data.response_max_len"),
    reals("algo.entropy_coef", 0),
    Range(
        "algo.tis_cap",
        lambda v: v is None or (is_real(v) and v >= 1),
        "null (off) or >= 1, the largest importance weight a token gets (typically 2)",
    ),
    Range(
        "algo.decoupled_is_cap",
        lambda v: v is None or (is_real(v) and v > 1),
        "null (off) or > 1, the importance weight above which a token is dropped from the loss (AReaL: 5)",
    ),
    reals("algo.kl_coef", 0),
    reals("algo.distill_coef", 0, why="the teacher term's weight; 0 = no teacher"),
    reals("algo.gamma", 0, 1, why="discount factor"),
    reals("algo.lam", 0, 1, why="GAE lambda"),
    reals("algo.value_clip_eps", 0, lo_open=True, why="typically 0.2"),
    reals("algo.eps", 0, lo_open=True, why="added to the group std before dividing; typically 1e-6"),
    ints("algo.max_gen_batches", 1, "rollout rounds per step"),
    reals(
        "algo.overlong_penalty",
        0,
        why="the size of DAPO's overlong penalty; a negative one would reward overlong answers",
    ),
    # ---- eval
    ints("eval.every_n_steps", 0, "0 = off"),
    ints("eval.num_prompts", 0, "0 = the whole validation set"),
    ints("eval.samples_per_prompt", 1, "the k of mean@k and pass@k"),
    reals("eval.temperature", 0, why="0 = greedy"),
    reals("eval.pass_threshold", why="a sample passes when its score reaches it"),
    # ---- trainer
    choice("trainer.zero_stage", (0, 1, 2, 3), "DeepSpeed ZeRO stages are 0, 1, 2 or 3"),
    choice(
        "trainer.reference_memory",
        ("full", "sharded", "offloaded"),
        "use full (a whole copy per reference rank), sharded (ZeRO-3 over the reference ranks) or offloaded (sharded, in host memory)",
    ),
    reals("trainer.weight_decay", 0, why="weight decay, typically 0-0.1"),
    choice("trainer.optimizer", ("adamw", "sgd"), "use 'adamw' (the default) or 'sgd' (plain, no momentum)"),
    ints("trainer.seed", 0, _SEED_WHY, hi=_SEED_MAX),
    ints("trainer.torch_threads", 1, "torch threads per trainer process; at most the cores a trainer may use", hi=256),
    choice(
        "trainer.old_logprobs",
        OLD_LOGPROBS_MODES,
        "use auto (from the update's own forward where that is exact, else a forward of their own) or forward (always)",
    ),
    # ---- engine
    reals(
        "engine.kv_cache_gb",
        0,
        lo_open=True,
        why="GiB of KV cache per engine GPU (per worker on CPU); null = "
        "from gpu_memory_utilization on GPUs, what the engine holds at once on CPU",
        nullable=True,
    ),
    reals(
        "engine.gpu_memory_utilization",
        0,
        1,
        lo_open=True,
        why="the fraction of each GPU's memory vLLM may take",
        nullable=True,
    ),
    ints(
        "engine.torch_threads", 1, "threads per engine process (OMP_NUM_THREADS); at most the cores it may use", hi=256
    ),
    ints(
        "engine.sleep_level", 0, "vLLM's sleep levels: 0 off, 1 weights to CPU, 2 weights dropped", hi=2, nullable=True
    ),
    Range(
        "engine.block_size",
        lambda v: is_int(v) and 16 <= v <= 1024 and v % 16 == 0,
        "must be a multiple of 16 in [16, 1024] (tokens per KV-cache block), or null for 32 on CPU / vLLM's default on GPUs",
        when=_gpu_layout,
        nullable=True,
    ),
    Range(
        "engine.block_size",
        lambda v: is_int(v) and 32 <= v <= 1024 and v % 32 == 0,
        "must be a multiple of 32 in [32, 1024] (vLLM's CPU attention takes multiples of 32), or null for 32",
        when=lambda c: not _gpu_layout(c),
        nullable=True,
    ),
    choice(
        "model.warm_start",
        ("digit_reverse", "lookup_tool"),
        "'digit_reverse' (the digit task) or 'lookup_tool' (the tool-use task, experiment=tool_use)",
    ),
    # ---- env (multi-turn options; single_turn has none of these keys)
    ints("env.max_turns", 1, "model turns per trajectory"),
    ints(
        "env.max_tokens_per_turn", 1, "tokens one model turn may generate; null = data.response_max_len", nullable=True
    ),
    ints("env.max_observation_tokens", 1, "tokens of one observation; longer ones are cut and counted"),
    reals("env.tool_timeout_s", 0, lo_open=True, why="seconds one env.step (a tool call) may take"),
    ints("env.concurrency", 1, "trajectories in flight per engine"),
    choice(
        "env.reward",
        ("last", "sum", "per_turn"),
        "'last' (the last step's reward), 'sum' (every step's rewards added) or 'per_turn' (every step's, "
        "each on its turn's last token: algo=ppo, reinforce_pp, reinforce_pp_baseline)",
    ),
    reals(
        "env.reward_weight", why="multiplies the reward group's score of the transcript; 0 leaves the reward group out"
    ),
    choice(
        "env.observation_format",
        ("chat_template", "plain"),
        "'chat_template' (the tokenizer renders the new messages) or 'plain' (their text, for models whose "
        "template renders no tool or user turns, like the tiny model)",
    ),
    choice(
        "env.observation_truncate_side",
        ("tail", "head", "middle"),
        "which part of a too-long observation's content is cut: 'tail' (its end), 'head' (its start) or "
        "'middle' (both ends kept, a marker between)",
    ),
    choice(
        "env.tokenization_sanity_check_mode",
        ("strict", "warn", "off"),
        "'strict' (a context that differs from the chat template's rendering ends the run), 'warn' "
        "(logged once, counted in env/tokenization_mismatches), 'off', or null (strict with a chat "
        "template, off with observation_format=plain)",
        nullable=True,
    ),
    Range(
        "env.stop",
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v),
        "must be a list of non-empty strings that end a model turn, e.g. ['</sql>', '</answer>']",
    ),
    Range(
        "env.tool_format",
        lambda v: isinstance(v, str) and bool(v.strip()),
        "must be 'hermes' (<tool_call>{json}</tool_call>, Qwen/Hermes chat models), 'tags' (<python>code</python>), "
        "or a vLLM tool parser's name (llama3_json, mistral, qwen3_coder, ...)",
    ),
    ints("env.tool_memory_mb", 16, "address space of one tool process, MB"),
    ints("env.tool_cpu_s", 1, "CPU seconds of one tool process"),
    ints("env.tool_max_output_bytes", 1, "bytes of tool output the model sees; the rest is cut, with a marker"),
    text("env.path", "a Python file defining the environment class (env=agent: the agent function)"),
    Range(
        "env.name",
        lambda v: isinstance(v, str) and v.isidentifier(),
        "must be the name of a class in env.path (env=agent: of a function)",
    ),
    ints("env.max_calls", 1, "chat-completions calls one agent trajectory may make"),
    reals("env.timeout_s", 0, lo_open=True, why="seconds one agent function may run, its calls included"),
    choice(
        "env.host",
        ("auto", "loopback", "node"),
        "'auto' (loopback on a one-node cluster, else the node's address), 'loopback' or 'node'",
    ),
    choice(
        "env.sampling",
        ("call", "run"),
        "'call' (an agent call's own temperature, top_p, top_k, penalties and seed are honoured) or 'run' "
        "(replaced by the run's sampling)",
    ),
    Range("env.served_model_name", lambda v: isinstance(v, str) and bool(v.strip()), "must be a non-empty model name"),
    Range(
        "env.reasoning_parser",
        lambda v: isinstance(v, str) and bool(v.strip()),
        "must be 'none' or a vLLM reasoning parser's name (qwen3, deepseek_r1, ...)",
    ),
    Range(
        "env.tool_parser",
        lambda v: isinstance(v, str) and bool(v.strip()),
        "must be 'hermes' (<tool_call>{json}</tool_call> become tool_calls, Qwen/Hermes chat models), 'none', "
        "or a vLLM tool parser's name (llama3_json, mistral, qwen3_coder, ...)",
    ),
    # ---- checkpoint
    ints("checkpoint.every_n_steps", 0, "0 = only at the end of the run and on signals"),
    reals("checkpoint.every_n_minutes", 0, why="minutes of training between time-based checkpoints; 0 = off"),
    ints("checkpoint.keep_last", 1, "complete checkpoints kept"),
    text("checkpoint.dir", "null = <run dir>/checkpoints", nullable=True),
    # ---- fault
    ints("fault.max_engine_restarts", 0, "0 = no engine restarts"),
    ints("fault.max_trainer_restarts", 0, "0 = a lost trainer (or engine outside generation) ends the run"),
    reals("fault.step_timeout_s", 0, lo_open=True, why="seconds any wait on an actor within a step may take"),
    # ---- logger
    ints("logger.plot_every_n_steps", 0, "0 = plots only at the end of the run"),
    ints(
        "logger.rollouts_per_step",
        1,
        "sequences of each step written to <run dir>/rollouts/ (logger.rollouts=false: none)",
    ),
    ints("logger.rollouts_every_n_steps", 1, "1 = the rollout dump of every step"),
    Range(
        "logger.project",
        lambda v: isinstance(v, str)
        and v.strip() != ""
        and len(v) <= 128
        and not any(ch in v for ch in _WANDB_BAD_CHARS),
        f"W&B project names are 1-128 characters without any of {_WANDB_BAD_CHARS}",
        when=lambda c: isinstance(c.logger, WandbLoggerConfig),
    ),
    choice(
        "logger.mode",
        ("online", "offline", "disabled", "shared"),
        "use online, offline or disabled (or null: online with WANDB_API_KEY, else offline)",
        nullable=True,
        when=lambda c: isinstance(c.logger, WandbLoggerConfig),
    ),
    text(
        "logger.entity",
        "a W&B user or team, or null for the default",
        nullable=True,
        when=lambda c: isinstance(c.logger, WandbLoggerConfig),
    ),
    # ---- launcher
    ints("launcher.logical_gpus", 0, "0 = only real GPUs"),
    choice(
        "launcher.memory_check",
        ("refuse", "warn"),
        "'refuse' (a plan that does not fit exits 2 before Ray starts) or 'warn' (say so and run)",
    ),
    reals(
        "launcher.memory_margin",
        0,
        0.5,
        hi_open=True,
        why="the fraction of each device the memory plan keeps free "
        "(0.05: what the plan was measured short by, with room); 0 plans to the last byte",
    ),
    reals(
        "placement.gpu_memory_gb",
        0,
        lo_open=True,
        why="memory of one GPU as sold (80 for an A100/H100 80GB: 85.0e9 bytes, GiB less the driver's 1 %); null = this machine's",
        nullable=True,
    ),
    reals(
        "placement.host_memory_gb",
        0,
        lo_open=True,
        why="RAM of one node as sold, in GiB (offloaded optimizer states and "
        "sleeping engines' weights live there); null = this machine's where it has CUDA GPUs",
        nullable=True,
    ),
    ints("launcher.num_cpus", 1, "logical CPUs for Ray; null = the default", nullable=True),
    reals("launcher.startup_timeout_s", 0, lo_open=True, why="seconds actors and placement groups may take to start"),
    # ---- root
    ints("seed", 0, _SEED_WHY, hi=_SEED_MAX),
    Range(
        "experiment_name",
        lambda v: isinstance(v, str) and v.strip() not in ("", ".", "..") and "/" not in v and "\\" not in v,
        "must be a non-empty name without '/' (it names the run's directory under outputs/)",
    ),
)


def lookup(cfg: Any, key: str) -> Any:
    """The value at a dotted key of the typed config; a sentinel no check accepts when the chosen
    option has no such key."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, _ABSENT)
        if node is _ABSENT:
            return _ABSENT
    return node


def validate_values(cfg: RootConfig) -> None:
    """`RANGES` alone: needs no plan, so a caller can run it before the planner and the group
    constructors (which stop at the first bad value) to list every bad value at once."""
    problems = range_problems(cfg)
    if problems:
        raise ConfigError(problems)


def range_problems(cfg: RootConfig) -> list[Problem]:
    problems = []
    for r in RANGES:
        value = lookup(cfg, r.key)
        if value is _ABSENT or (value is None and r.nullable):
            continue
        if r.when is not None and not r.when(cfg):
            continue
        if not r.ok(value):
            problems.append(Problem(r.key, value, r.fix))
    return problems


def added_key_problems(cfg: Any, path: str = "") -> list[Problem]:
    """Keys added with Hydra's `+key=value` that the chosen option has no field for (Hydra appends
    them to a structured node, and nothing would read them): `+transfer.token_budget=4096` with
    `transfer=padded` is refused, naming the keys the option does take."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return []
    fields = {f.name for f in dataclasses.fields(cfg)}
    problems = []
    for name, value in vars(cfg).items():
        key = f"{path}{name}"
        if name not in fields:
            target = getattr(cfg, "_target_", None)
            owner = (
                f"{path.rstrip('.')} ({target.rsplit('.', 1)[-1]})"
                if isinstance(target, str) and path
                else path.rstrip(".") or "the config"
            )
            takes = ", ".join(sorted(f for f in fields if f != "_target_")) or "no keys"
            problems.append(Problem(key, value, f"{owner} has no such key (it takes: {takes}); remove it"))
        else:
            problems.extend(added_key_problems(value, key + "."))
    return problems
