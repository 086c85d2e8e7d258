"""Checks of values and derived quantities, run on the driver before Ray or any actor starts.

Each check is a small function returning the problems it found; every problem names the config
key, the value it has, and the fix. `validate` runs them all and raises one `ConfigError`
listing every problem, so a user fixes everything in one go.

The valid range of every single key is one row of `RANGES` (rlhf_orch.config.ranges). Checks
between keys (sums, divisibility, one key against another) are the functions in `CHECKS` here.
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
    ReasoningGymDataConfig,
    ReasoningGymRuleConfig,
    AgentEnvConfig,
    ClusterLauncherConfig,
    ColocatedPlacementConfig,
    CountdownRuleConfig,
    CustomRewardConfig,
    CpuLocalPlacementConfig,
    DigitRuleConfig,
    DigitTaskConfig,
    KL_DIVERGENCE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    FilesDataConfig,
    GSM8KRuleConfig,
    LocalLauncherConfig,
    LoraConfig,
    MathVerifyRuleConfig,
    ModelRewardConfig,
    MultiTurnEnvConfig,
    PackedTransferConfig,
    RootConfig,
    SplitPlacementConfig,
    TinyModelConfig,
)
from rlhf_orch.checkpoint_dirs import OWN_RUN_DIR
from rlhf_orch.config.problems import ConfigError, Problem
from rlhf_orch.config.ranges import is_int, is_real, lookup, range_problems
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.topology.plan import PlacementPlan


# The env options whose rollouts are trajectories the engines drive (their rewards are made there).
TRAJECTORY_ENVS = (MultiTurnEnvConfig, AgentEnvConfig)


@dataclass(frozen=True)
class Hardware:
    """What this machine (or the Ray cluster) offers, as far as checks need to know."""

    gpus: int  # GPUs Ray will offer (real, or logical when launcher.logical_gpus is set)
    cuda: bool  # real CUDA devices where the roles run (the launcher says: NCCL and CUDA IPC need them)


def _ranges(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    return range_problems(cfg)


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
    problems = []
    total = d.prompt_max_len + d.response_max_len
    if total > m.context_len:
        problems.append(
            Problem(
                "data.response_max_len",
                d.response_max_len,
                f"data.prompt_max_len + data.response_max_len = {total} exceeds model.context_len={m.context_len}; "
                f"lower data.response_max_len to {max(m.context_len - d.prompt_max_len, 0)} or pick a longer-context model",
            )
        )
    if is_int(cfg.algo.min_response_len) and cfg.algo.min_response_len > d.response_max_len:
        problems.append(Problem(
            "algo.min_response_len", cfg.algo.min_response_len,
            f"a response cannot have more than data.response_max_len={d.response_max_len} tokens; "
            f"set algo.min_response_len <= {d.response_max_len}",
        ))
    if is_int(cfg.algo.min_response_len) and cfg.algo.min_response_len > 0 and isinstance(cfg.env, TRAJECTORY_ENVS):
        problems.append(Problem(
            "algo.min_response_len", cfg.algo.min_response_len,
            "a multi-turn trajectory's turns end where the environment needs them to (a tool call, an answer); "
            "a minimum length per response would run past them: leave algo.min_response_len=0 with env",
        ))
    return problems


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
    e = cfg.engine
    problems = []
    if is_int(e.sleep_level) and e.sleep_level > 0 and plan.total_gpus == 0:
        problems.append(Problem("engine.sleep_level", e.sleep_level, "vLLM's sleep mode frees GPU memory and needs a GPU "
                                "layout; use 0 (or null) with placement=cpu_local"))
    if e.gpu_memory_utilization is not None and plan.total_gpus == 0:
        problems.append(Problem("engine.gpu_memory_utilization", e.gpu_memory_utilization, "CPU engines size their KV "
                                "cache by engine.kv_cache_gb only; leave it null with placement=cpu_local"))
    if e.gpu_memory_utilization is not None and e.kv_cache_gb is not None and plan.total_gpus > 0:
        problems.append(Problem("engine.gpu_memory_utilization", e.gpu_memory_utilization, "vLLM ignores it when the KV "
                                f"cache size is given (engine.kv_cache_gb={e.kv_cache_gb:g}): leave one of the two null"))
    return problems


def _algorithm(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:

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
    if a.tis_cap is not None and a.decoupled_is_cap is not None:
        # Both weight each token's loss by pi_old / pi_engine: together a token would be weighted twice.
        problems.append(
            Problem(
                "algo.decoupled_is_cap",
                a.decoupled_is_cap,
                f"correct for the engine's sampling with one of the two: set algo.tis_cap=null (it is {a.tis_cap:g}) "
                "for AReaL's decoupled PPO, or algo.decoupled_is_cap=null for truncated IS",
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
    """The packed token budget vs sequence length; prompt sharing needs packed micro-batches."""
    t, d, a = cfg.transfer, cfg.data, cfg.algo
    if not isinstance(t, PackedTransferConfig):
        if cfg.trainer.share_prompts:
            return [Problem("trainer.share_prompts", True, "a shared prompt needs packed micro-batches (padded ones keep a row "
                            "per sequence): use transfer=packed, or leave trainer.share_prompts null")]
        return []
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


def _env(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """Multi-turn rollouts: a turn fits the trajectory's budget, the engines score what they
    generate (the environments live there), and the reward is one the engines can finish."""
    env = cfg.env
    if not isinstance(env, TRAJECTORY_ENVS):
        return []
    problems = []
    budget = cfg.data.response_max_len
    if is_int(env.max_tokens_per_turn) and env.max_tokens_per_turn > budget:
        problems.append(Problem(
            "env.max_tokens_per_turn", env.max_tokens_per_turn,
            f"a turn must fit the whole trajectory's budget data.response_max_len={budget}; "
            f"set env.max_tokens_per_turn <= {budget} or raise data.response_max_len",
        ))
    if not getattr(get_class(cfg.transfer._target_), "scores_on_engines", True):
        problems.append(Problem(
            "transfer", cfg.transfer._target_.rsplit(".", 1)[-1],
            "the padded baseline scores rollouts on the driver, and a trajectory's reward comes from its environment, "
            "which lives on the engine that played it; use transfer=packed or transfer=micro_batched",
        ))
    if getattr(env, "reward", None) == "per_turn":
        # refused where it would place every reward on the last token anyway (the same as sum)
        if not cfg.algo.per_token_rewards:
            why = (f"algo {cfg.algo._target_.rsplit('.', 1)[-1]} gives a trajectory one advantage from one score, so "
                   "per-turn rewards would only add up: use env.reward=sum, or an algorithm whose advantages read "
                   "rewards per token (algo=ppo, reinforce_pp, reinforce_pp_baseline)")
        elif not env.rewards_each_turn:
            why = (f"env {env._target_.rsplit('.', 1)[-1]} rewards only the final answer, so every reward would sit on "
                   "the last token: use env.reward=sum")
        elif env.max_turns == 1:
            why = "with env.max_turns=1 the only turn's reward sits on the last token: use env.reward=sum"
        else:
            why = None
        if why:
            problems.append(Problem("env.reward", "per_turn", why))
    raw = cfg.data.raw_prompts()
    if env.continues_chat_template and raw:
        problems.append(Problem(
            "env.observation_format", "chat_template",
            f"observations are the chat template's text after each turn, but {raw}, not the template's rendering: every "
            "trajectory's context would differ from the template's at token 0; set env.observation_format=plain, or use "
            "chat-templated prompts (data=files or data=reasoning_gym with data.chat_template=true)",
        ))
    host_problems = getattr(get_class(env._target_), "host_problems", None)
    if host_problems is not None:  # e.g. env=python_tool: this host's sandbox (probed here, before Ray)
        problems += [Problem(key, value, why) for key, value, why in host_problems(env)]
    config_problems = getattr(get_class(env._target_), "config_problems", None)
    if config_problems is not None:  # e.g. env=skyrl: environments running the model's code, the rows' env_class read here
        problems += [Problem(key, value, why) for key, value, why in config_problems(env, cfg.data)]
    if isinstance(cfg.reward, ModelRewardConfig):
        problems.append(Problem(
            "reward", "model",
            "a reward model scores after the hand-over and would replace the environments' rewards the engines "
            "attached; with env, score the transcript with a rule or reward=custom (env.reward_weight) instead",
        ))
    return problems


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
    if scores is not None and is_real(e.pass_threshold):
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
    if isinstance(r, (GSM8KRuleConfig, CountdownRuleConfig)) and is_real(r.score) and is_real(r.format_score):
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
        if all(is_real(v) for v in roles.values()) and sum(roles.values()) > 1 + 1e-9:
            keys = sorted({"reference" if r == "reward" else r for r in roles})
            problems.append(
                Problem("+".join(f"placement.{k}_fraction" for k in keys), round(sum(roles.values()), 6),
                        f"every role ({', '.join(roles)}) shares GPU 0, so their fractions must sum to <= 1; lower them")
            )
        util = cfg.engine.gpu_memory_utilization
        if is_real(util) and is_real(p.engine_fraction) and util > p.engine_fraction + 1e-9:
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
        if d.long_tail_len > d.response_max_len:
            problems.append(Problem("data.long_tail_len", d.long_tail_len, f"must be <= data.response_max_len={d.response_max_len}"))
        if bool(d.long_tail_frac) != bool(d.long_tail_len):
            key, value = ("data.long_tail_len", d.long_tail_len) if d.long_tail_len else ("data.long_tail_frac", d.long_tail_frac)
            problems.append(Problem(key, value, "does nothing alone: set both data.long_tail_frac (> 0) and data.long_tail_len (> 0), or neither"))
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
    if isinstance(r, (GSM8KRuleConfig, CountdownRuleConfig)) and is_real(r.score) and is_real(r.format_score):
        if r.score <= r.format_score:
            problems.append(
                Problem("reward.score", r.score, f"a correct answer must score more than a wrong one "
                        f"(reward.format_score={r.format_score:g}): use e.g. reward.score=1.0")
            )
    if isinstance(r, CustomRewardConfig) and r.batched is True and is_int(r.pool_size) and r.pool_size > 0:
        problems.append(
            Problem("reward.pool_size", r.pool_size, "reward.batched=true scores the whole batch in one call on the "
                    "engine, never in a pool: set reward.pool_size=0 (or reward.batched=false to score per sample in the pool)")
        )
    rules = {"reward": r, "reward.rule": getattr(r, "rule", None)}
    for key in [k for k, x in rules.items() if isinstance(x, ReasoningGymRuleConfig)]:
        if isinstance(cfg.data, ReasoningGymDataConfig):
            continue
        problems.append(
            Problem(key, "reasoning_gym", "scores reasoning-gym entries, which only data=reasoning_gym gives as labels: "
                    "use data=reasoning_gym data.task=<dataset>, or a reward for your data")
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
    step = lookup(cfg, "fault.step_timeout_s")
    if not is_real(step) or step <= 0:
        return []
    problems = []
    if is_real(cfg.sync.timeout_s) and cfg.sync.timeout_s > step:
        problems.append(
            Problem("fault.step_timeout_s", step, f"a step waits on the weight sync, so sync.timeout_s="
                    f"{cfg.sync.timeout_s:g} could never fire: use fault.step_timeout_s >= {cfg.sync.timeout_s:g} "
                    "(or a lower sync.timeout_s)")
        )
    for key in ("reward.timeout_s", "reward.rule.timeout_s"):
        limit = lookup(cfg, key)
        if is_real(limit) and limit > step:
            problems.append(
                Problem(key, limit, f"one sample's scoring limit exceeds fault.step_timeout_s={step:g}, the longest "
                        "wait without progress (each scored sample counts as the engine's progress, one sample "
                        "takes up to this): use less (typical 10)")
            )
    tool = lookup(cfg, "env.tool_timeout_s")
    env_class = get_class(cfg.env._target_) if isinstance(getattr(cfg.env, "_target_", None), str) else None
    if is_real(tool) and hasattr(env_class, "step_wait_s") and env_class.step_wait_s(tool) > step:
        # While every trajectory on an engine waits in a tool call the engine makes no step: past
        # fault.step_timeout_s it would be taken for a hung engine and the run restarted.
        problems.append(
            Problem("env.tool_timeout_s", tool, f"one environment step may take {env_class.step_wait_s(tool):g}s, more than "
                    f"fault.step_timeout_s={step:g}, the longest wait without an engine step: use less (or raise fault.step_timeout_s)")
        )
    return problems


def _lora(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """model.lora: keys that do nothing at rank 0; what an adapter-serving engine cannot do."""
    lora, defaults = cfg.model.lora, LoraConfig()
    if lora.rank == 0:
        return [Problem(f"model.lora.{key}", getattr(lora, key), "does nothing at model.lora.rank=0 (full fine-tuning): "
                        "set model.lora.rank > 0 or drop the key")
                for key in ("alpha", "dropout", "target_modules", "sync") if getattr(lora, key) != getattr(defaults, key)]
    problems = []
    if lora.sync != "merged" and cfg.engine.sleep_level == 2:
        # (auto too: it takes the adapter wherever vLLM serves one, which is known only in the engine)
        problems.append(Problem("engine.sleep_level", 2, "level 2 drops the engines' base weights and an adapter update "
                                "does not bring them back: use engine.sleep_level=1, or model.lora.sync=merged"))
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    refused = LoraSettings(rank=lora.rank, target_modules=targets).refused_targets()
    if refused:
        problems.append(Problem("model.lora.target_modules", targets, f"no adapter on the embedding or the output head "
                                f"({refused}): target the decoder's linear layers (q_proj, ..., or all-linear)"))
    return problems


def _offload(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    if cfg.trainer.offload_optimizer and not hw.cuda:
        return [Problem("trainer.offload_optimizer", True, "offloading moves optimizer states from GPU to host memory; "
                        "without CUDA GPUs they are in host memory already: drop it (a dry run plans a GPU layout "
                        "with it: launcher.dry_run=true)")]
    return []


def _reference_memory(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """trainer.reference_memory: refused where it does nothing or cannot be done."""
    how = cfg.trainer.reference_memory
    if how == "full":
        return []
    ranks = plan.num_ranks("reference")
    if ranks == 0:
        why = "the algorithm has no KL reference" if not cfg.algo.needs_reference else "no reference rank is planned"
        return [Problem("trainer.reference_memory", how, f"does nothing: {why}; drop the key")]
    if cfg.model.lora.rank > 0 and plan.reference_in_actor:
        return [Problem("trainer.reference_memory", how, "does nothing: under model.lora the policy ranks' reference is "
                        "the policy's own frozen base (no second copy); drop the key")]
    if how == "offloaded" and not hw.cuda:
        return [Problem("trainer.reference_memory", how, "offloading keeps the reference's shards in host memory instead "
                        "of GPU memory; without CUDA GPUs it is in host memory already: use full or sharded")]
    if how == "sharded" and ranks == 1:
        return [Problem("trainer.reference_memory", how, "sharding over one reference rank keeps the whole model: plan more "
                        "reference ranks (placement.reference_ranks, or the policy's ranks with "
                        "placement.reference_in_actor), or use offloaded (GPU layouts)")]
    return []


def _launcher(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    lc = cfg.launcher
    problems = []
    if lc.keep_actors and not lc.reuse_session:
        problems.append(Problem("launcher.keep_actors", lc.keep_actors, "keeps a run's actors for the next run in "
                                "the same Ray session: set launcher.reuse_session=true too, or leave keep_actors false"))
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
    from rlhf_orch.topology.placement import MIN_LOGICAL_CPUS

    return max(os.cpu_count() or 1, MIN_LOGICAL_CPUS)


def _paths(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    resume = lookup(cfg, "resume")
    if isinstance(resume, str) and resume not in ("auto", OWN_RUN_DIR) and not Path(resume).expanduser().exists():
        problems.append(Problem("resume", resume, "no such run or checkpoint directory; give an existing one, "
                                f"'auto' (the latest checkpoint of this experiment_name), '{OWN_RUN_DIR}' (this run's own "
                                "hydra.run.dir, if it has a checkpoint) or null"))
    ckpt = lookup(cfg, "checkpoint.dir")
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
    _env,
    _evaluation,
    _placement,
    _data,
    _reward,
    _timeouts,
    _launcher,
    _paths,
    _offload,
    _reference_memory,
    _lora,
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
