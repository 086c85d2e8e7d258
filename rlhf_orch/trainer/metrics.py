"""The trainer's logged metrics of one step, from what each rank returned (pure; the loop and the
oracle tests read the same definitions).

Every policy statistic is defined per optimizer step and then averaged over the steps of the
rollout (all `ppo_epochs`): `loss/policy` is the step's loss as back-propagated (aggregated as
`algo.loss_agg` says, KL and entropy terms included); `policy/clipfrac`, `policy/approx_kl`,
`loss/kl`, `policy/entropy`, `policy/tis_*`, `policy/decoupled_*` are token means over the step's
action tokens (whatever the loss aggregation and however the step was cut). Each rank returns its
share times the number of ranks, so the mean over ranks is the whole step's value. Gradient norms
are the largest pre-clipping norm of any step. `kl` and `values/mean` are token means over the rollout.
The statistics of the old log-probs (`kl`, `rollout/logprob_diff_*`) come from the experience phase
or, where the update's own forward gave the old log-probs (trainer.old_logprobs), from the update.
"""

from __future__ import annotations

from typing import Any, Sequence

POLICY_KEYS = {
    "policy_loss": "loss/policy",
    "clipfrac": "policy/clipfrac",
    "approx_kl": "policy/approx_kl",
    "clipfrac_dual": "policy/clipfrac_dual",
    "kl_loss": "loss/kl",
    "entropy": "policy/entropy",
    "tis_weight": "policy/tis_weight",
    "tis_capped": "policy/tis_capped_frac",
    "decoupled_weight": "policy/decoupled_weight",
    "decoupled_dropped": "policy/decoupled_dropped_frac",
}
CRITIC_KEYS = {"value_loss": "loss/value", "vf_clipfrac": "critic/vf_clipfrac"}
# The statistics of the old log-probs (sums and a max over a rank's action tokens, for `kl` and
# rollout/logprob_diff_*): in the experience's stats, or the update's where its own forward gave
# the old log-probs (`experience.old_logprob_stats`).
OLD_LOGPROB_STATS = ("kl_sum", "logprob_diff_max", "logprob_diff_sum", "logprob_diff_tokens", "logprob_diff_over")


def _mean(rows: Sequence[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


def _max(rows: Sequence[dict[str, float]], key: str) -> float:
    # max() over floats drops a NaN when it is not first; the driver's guard must see it.
    values = [r[key] for r in rows]
    return float("nan") if any(v != v for v in values) else max(values)


def trainer_metrics(
    exp_stats: Sequence[dict[str, float]],
    policy_stats: Sequence[dict[str, float]],
    critic_stats: Sequence[dict[str, float]],
    uses_reference: bool,
) -> dict[str, Any]:
    """`exp_stats` / `policy_stats`: one dict per policy rank (`PolicyWorker.make_experience`,
    `.train`); `critic_stats`: one per critic rank (empty without a critic)."""
    # Each rank's old-log-prob statistics, wherever that rank measured them.
    exp_stats = [
        {**e, **{k: p[k] for k in OLD_LOGPROB_STATS if k in p}} for e, p in zip(exp_stats, policy_stats, strict=True)
    ]
    metrics: dict[str, Any] = {}
    for key, name in POLICY_KEYS.items():
        if key in policy_stats[0]:
            metrics[name] = _mean(policy_stats, key)
    if "grad_norm" in policy_stats[0]:
        metrics["policy/grad_norm"] = _max(policy_stats, "grad_norm")
    metrics["advantages/abs_max"] = _max(exp_stats, "advantages_abs_max")
    # 1: the update's own forward gave the old log-probs (`trainer.old_logprobs`); 0: a forward of their own.
    metrics["trainer/old_logprobs_from_update"] = min(r["old_logprobs_from_update"] for r in exp_stats)
    if "logprob_diff_max" in exp_stats[0]:
        metrics["rollout/logprob_diff_max"] = _max(exp_stats, "logprob_diff_max")
    if "logprob_diff_tokens" in exp_stats[0]:
        # The typical token beside the worst one: a mean at float noise with a large max is a
        # rare numerically fragile token; a large mean is a systematic mismatch (docs/real_model.md).
        compared = max(sum(r["logprob_diff_tokens"] for r in exp_stats), 1.0)
        metrics["rollout/logprob_diff_mean"] = sum(r["logprob_diff_sum"] for r in exp_stats) / compared
        metrics["rollout/logprob_diff_over_frac"] = sum(r["logprob_diff_over"] for r in exp_stats) / compared
    tokens = max(sum(r["response_tokens"] for r in exp_stats), 1.0)
    if uses_reference:
        metrics["kl"] = sum(r["kl_sum"] for r in exp_stats) / tokens
    if "distill_kl_sum" in exp_stats[0]:
        # The per-token reverse KL to the teacher (k1: log pi_old - log pi_teacher of the sampled
        # tokens), the quantity on-policy distillation lowers.
        metrics["distill/reverse_kl"] = sum(r["distill_kl_sum"] for r in exp_stats) / tokens
    if critic_stats:
        metrics["values/mean"] = sum(r["values_sum"] for r in exp_stats) / tokens
        for key, name in CRITIC_KEYS.items():
            metrics[name] = _mean(critic_stats, key)
        if "grad_norm" in critic_stats[0]:
            metrics["critic/grad_norm"] = _max(critic_stats, "grad_norm")
    return metrics
