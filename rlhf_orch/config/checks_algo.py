"""Cross-key checks of the algorithm, the reward and evaluation: the loss and KL settings, what the
algorithm needs of the rollout, reward relations, pass thresholds against the reward's range
(`rlhf_orch.config.validate.CHECKS` runs them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_orch.algo.options import KL_DIVERGENCE_ESTIMATORS, LOSS_AGGREGATIONS
from rlhf_orch.config.checks_shapes import is_local_path
from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.ranges import is_int, is_real
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.data.options import DigitTaskConfig, FilesDataConfig, ReasoningGymDataConfig
from rlhf_orch.reward.options import (
    CountdownRuleConfig,
    CustomRewardConfig,
    DigitRuleConfig,
    GSM8KRuleConfig,
    MathVerifyRuleConfig,
    ModelRewardConfig,
    ReasoningGymRuleConfig,
)
from rlhf_orch.topology.plan import PlacementPlan


def algorithm(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    a = cfg.algo
    problems = []
    if a.loss_agg not in LOSS_AGGREGATIONS:
        problems.append(Problem("algo.loss_agg", a.loss_agg, f"use one of {', '.join(LOSS_AGGREGATIONS)}"))
    if a.kl_placement not in ("in_reward", "in_loss", "off"):
        problems.append(
            Problem(
                "algo.kl_placement",
                a.kl_placement,
                "use 'in_reward' (a reward penalty), 'in_loss' (a loss term) or 'off'",
            )
        )
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
        problems.append(
            Problem("algo.kl_estimator", a.kl_estimator, f"use one of {', '.join(KL_DIVERGENCE_ESTIMATORS)}")
        )
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
            Problem(
                "algo.overlong_buffer",
                a.overlong_buffer,
                f"must be in [0, data.response_max_len={cfg.data.response_max_len})",
            )
        )
    return problems


def teacher(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """The teacher group against the algorithm's teacher term (algo.distill_coef)."""
    a, t = cfg.algo, cfg.teacher
    if a.uses_teacher and t is None:
        return [
            Problem(
                "teacher",
                "none",
                f"algo.distill_coef={a.distill_coef:g} reads a teacher's log-prob of every sampled token: set "
                "teacher=<model option> sharing the policy's tokenizer (e.g. teacher=smollm2_135m for "
                "model=smollm2_student)",
            )
        ]
    if t is None:
        return []
    name = str(getattr(t, "name_or_path", None) or getattr(t, "gguf_file", None) or type(t).__name__)
    if not a.uses_teacher:
        return [
            Problem(
                "teacher",
                name,
                "does nothing: no term of the algorithm reads a teacher (algo.distill_coef=0); use "
                "algo=on_policy_distill, set algo.distill_coef>0 beside another algorithm, or teacher=none",
            )
        ]
    problems = []
    if t.lora.rank > 0:
        problems.append(
            Problem("teacher.lora.rank", t.lora.rank, "the teacher is frozen: adapters on it train nothing; set 0")
        )
    longest = cfg.data.prompt_max_len + cfg.data.response_max_len
    if t.context_len < longest:
        problems.append(
            Problem(
                "teacher.context_len",
                t.context_len,
                f"the teacher scores whole sequences of up to data.prompt_max_len + data.response_max_len = {longest} "
                "tokens: raise it (up to its checkpoint's position limit) or shorten the data's lengths",
            )
        )
    if getattr(a, "dynamic_sampling", False):
        problems.append(
            Problem(
                "algo.distill_coef",
                a.distill_coef,
                "dynamic sampling drops every group of equal scores, and with it the teacher's signal on those "
                "samples: set algo.dynamic_sampling=false, or algo.distill_coef=0",
            )
        )
    return problems


def evaluation(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
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
                Problem(
                    "data.eval_size",
                    0,
                    "evaluation is on (eval.every_n_steps/eval.before_train) but there are no "
                    "held-out prompts: set data.eval_size > 0 (e.g. 64) or turn evaluation off",
                )
            )
        elif isinstance(d, FilesDataConfig) and not d.val_files:
            problems.append(
                Problem(
                    "data.val_files",
                    [],
                    "evaluation is on (eval.every_n_steps/eval.before_train) but there is no "
                    "validation set: set data.val_files=[...] or eval.every_n_steps=0 eval.before_train=false",
                )
            )
    scores = _rule_score_range(cfg)
    if scores is not None and is_real(e.pass_threshold):
        lo, hi = scores
        if e.pass_threshold > hi:
            problems.append(
                Problem(
                    "eval.pass_threshold",
                    e.pass_threshold,
                    f"the reward scores at most {hi:g}, so no sample could "
                    f"pass (pass@k always 0); use a threshold in ({lo:g}, {hi:g}], e.g. {hi:g}",
                )
            )
        elif e.pass_threshold <= lo:
            problems.append(
                Problem(
                    "eval.pass_threshold",
                    e.pass_threshold,
                    f"the reward scores at least {lo:g}, so every sample "
                    f"would pass (pass@k always 1); use a threshold in ({lo:g}, {hi:g}], e.g. {hi:g}",
                )
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


def reward(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    r = cfg.reward
    problems = []
    if isinstance(r, (GSM8KRuleConfig, CountdownRuleConfig)) and is_real(r.score) and is_real(r.format_score):
        if r.score <= r.format_score:
            problems.append(
                Problem(
                    "reward.score",
                    r.score,
                    f"a correct answer must score more than a wrong one "
                    f"(reward.format_score={r.format_score:g}): use e.g. reward.score=1.0",
                )
            )
    if isinstance(r, CustomRewardConfig) and r.batched is True and is_int(r.pool_size) and r.pool_size > 0:
        problems.append(
            Problem(
                "reward.pool_size",
                r.pool_size,
                "reward.batched=true scores the whole batch in one call on the "
                "engine, never in a pool: set reward.pool_size=0 (or reward.batched=false to score per sample in the pool)",
            )
        )
    rules = {"reward": r, "reward.rule": getattr(r, "rule", None)}
    for key in [k for k, x in rules.items() if isinstance(x, ReasoningGymRuleConfig)]:
        if isinstance(cfg.data, ReasoningGymDataConfig):
            continue
        problems.append(
            Problem(
                key,
                "reasoning_gym",
                "scores reasoning-gym entries, which only data=reasoning_gym gives as labels: "
                "use data=reasoning_gym data.task=<dataset>, or a reward for your data",
            )
        )
    if isinstance(r, ModelRewardConfig):
        rule_weight = r.rule_weight if r.rule is not None else 0
        if r.weight == 0 and rule_weight == 0:
            problems.append(
                Problem(
                    "reward.weight",
                    r.weight,
                    "with no rule (or reward.rule_weight=0) every score would be 0: use a weight != 0 (e.g. 1.0)",
                )
            )
        if is_local_path(r.model_path) and not Path(r.model_path).expanduser().exists():
            problems.append(
                Problem(
                    "reward.model_path",
                    r.model_path,
                    "no such directory; give an existing "
                    "sequence-classification checkpoint, a hub id, or null (the tiny one)",
                )
            )
    return problems
