"""Policy-gradient losses shared by PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++ and DAPO.

Each loss returns a per-token loss matrix `[B, T]` (0 at masked positions); turning it into the
scalar that is back-propagated is one separate decision, `aggregate_loss`, so that the choice of
normaliser -- which is what distinguishes GRPO, Dr. GRPO and DAPO's token-level loss -- lives in
one place. Conventions are `ppo_math`'s: masked positions are selected away with `torch.where`
(never multiplied by 0), inputs are sanitised before `exp`, and a mean over nothing is 0.

Loss aggregation and data parallelism
-------------------------------------
Every mode is a sum of per-token terms divided by a normaliser that depends on the whole batch:

    loss = sum_{i,t} mask_it * w_it * loss_it / D

    mode                     w_it          D
    token-mean               1             number of action tokens
    seq-mean-token-sum       1             number of sequences
    seq-mean-token-mean      1 / n_i       number of sequences         (n_i: tokens of row i)
    seq-mean-token-sum-norm  1             number of sequences * norm_len

(`aggregation_weights` gives w, `loss_denominator` gives D; "sequences" are rows with at least one
action token.) w is per-sequence, D is global. So when the batch of one optimizer step is cut
into micro-batches and spread over data-parallel ranks, the caller:

    1. before the step, sums `loss_denominator(mb.mask, mode, norm_len)` over this rank's
       micro-batches of the step and all-reduces (SUM) it over the ranks -> D;
    2. for each micro-batch, back-propagates `aggregate_loss(loss_mat, mask, mode, denominator=D)`
       -- times the number of ranks if the engine averages gradients over ranks (DDP, DeepSpeed);
       and without the engine's own 1/gradient_accumulation_steps scaling.

The micro-batch losses then sum to exactly the one-shot loss of the whole step, whatever the
split. Without `denominator`, `aggregate_loss` uses its own batch's D (veRL's `agg_loss`, but see
`aggregate_loss` on seq-mean-token-sum-norm).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_orch.algo.ppo_math import kl_penalty, masked_mean


# --------------------------------------------------------------------------- loss aggregation
LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"loss aggregation {mode!r} is not known; allowed values: {list(LOSS_AGGREGATIONS)}"
        )


def aggregation_weights(mask: Tensor, mode: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token weights w `[B, T]` of `mode` (see the module docstring); 0 at masked positions.

    Only "seq-mean-token-mean" weights tokens unequally: 1 / (tokens of the row), so that every
    sequence counts once whatever its length (GRPO's original 1/|o_i|, whose length bias Dr. GRPO
    removes).
    """
    _check_mode(mode)
    keep = mask.bool()
    w = keep.to(dtype)
    if mode == "seq-mean-token-mean":
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return w


def loss_denominator(mask: Tensor, mode: str, norm_len: int | None = None) -> Tensor:
    """This batch's contribution D to the normaliser of `mode`, a float32 0-dim tensor.

    Additive over micro-batches and ranks: sum it over every micro-batch of an optimizer step on
    all ranks and pass the total to `aggregate_loss(..., denominator=)`.

        token-mean                number of action tokens
        seq-mean-token-*          number of sequences with at least one action token
        seq-mean-token-sum-norm   that number of sequences * norm_len

    `norm_len` (default: `mask.shape[-1]`) is Dr. GRPO's constant normaliser, MAX_TOKENS: the
    generation budget (max response length), the same for every sequence and every step so no
    sequence's tokens weigh more for being short. Pass it explicitly -- the default, the padded
    width, varies between micro-batches and is not a response length at all in a packed layout.
    """
    _check_mode(mode)
    keep = mask.bool()
    if mode == "token-mean":
        return keep.sum().to(torch.float32)
    sequences = keep.any(dim=-1).sum().to(torch.float32)
    if mode == "seq-mean-token-sum-norm":
        return sequences * float(mask.shape[-1] if norm_len is None else norm_len)
    return sequences


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    norm_len: int | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar: sum(mask * w * loss) / D (module docstring).

    Without `denominator`, D is this batch's own (`loss_denominator(mask, mode, norm_len)`):
        token-mean               sum over tokens / tokens
        seq-mean-token-sum       mean over sequences of their token sums
        seq-mean-token-mean      mean over sequences of their token means
        seq-mean-token-sum-norm  sum over tokens / (sequences * norm_len)   (Dr. GRPO)
    The first three are veRL's `agg_loss`, including its exclusion of sequences with no action
    token from the seq-means. For the last, veRL's `agg_loss` returns sum / norm_len (its
    `loss_scale_factor`) without dividing by the number of sequences, so its scale depends on the
    micro-batch size; here it is the mean over sequences that the mode's name and Dr. GRPO's
    objective (1/G sum_i sum_t ... / MAX_TOKENS) say. With `denominator`, `norm_len` is unused
    (it is part of D). D = 0 (nothing to average) gives 0, not NaN.
    """
    keep = mask.bool()
    # Reduce in at least float32: token counts past 256 are not exact in bf16.
    loss_mat = loss_mat.to(torch.promote_types(loss_mat.dtype, torch.float32))
    w = aggregation_weights(keep, mode, loss_mat.dtype)
    total = torch.where(keep, loss_mat * w, torch.zeros_like(loss_mat)).sum()
    if denominator is None:
        denominator = loss_denominator(keep, mode, norm_len)
    d = torch.as_tensor(denominator, dtype=total.dtype, device=total.device)
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    return torch.where(d > 0, total / safe_d, torch.zeros_like(total))


# --------------------------------------------------------------------------- KL to the reference
KL_DIVERGENCE_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def _k3_of_log_ratio(log_ratio: Tensor) -> Tensor:
    # ppo_math's k3 (e^d - d - 1) applied to a given log-ratio d = log(p/q): anchor logprobs at 0.
    return kl_penalty(torch.zeros_like(log_ratio), log_ratio, "k3")


def kl_divergence(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, `[B, T]`.

        k1          logp - ref                                 unbiased, can be < 0
        k2          1/2 (logp - ref)^2                         biased, >= 0
        k3          e^d - d - 1 with d = ref - logp            unbiased, >= 0, low variance
        low_var_kl  = k3 (veRL's name); both clamp d to [-20, 20] before exp and the
                    estimate to [-10, 10], as veRL's `kl_penalty` does for them

    Where each belongs: k1 (and k2) as a penalty in the reward, `r_t -= coef * kl_t`
    (`ppo_math.token_rewards`), or in the loss; k3 belongs in the loss, `+ coef * kl_t` aggregated
    like the policy loss -- as a reward penalty its policy gradient is biased. This is the
    documented default split: `kl.placement` "in_reward" with k1, "in_loss" with low_var_kl.
    (k1 and k3 share ppo_math's formulas; ppo_math's `kl_penalty` knows only k1/k3, unclamped.)

    `mask` (optional): masked positions are sanitised before any arithmetic and come back 0, so
    padding holding -inf cannot put NaN into gradients. Without it, padding values pass through.
    """
    if estimator not in KL_DIVERGENCE_ESTIMATORS:
        raise ValueError(
            f"KL estimator {estimator!r} is not known; "
            f"allowed values: {list(KL_DIVERGENCE_ESTIMATORS)}"
        )
    if mask is not None:
        keep = mask.bool()
        zero = torch.zeros_like(logprobs)
        logprobs = torch.where(keep, logprobs, zero)
        ref_logprobs = torch.where(keep, ref_logprobs, zero)
    if estimator == "k1":
        kl = kl_penalty(logprobs, ref_logprobs, "k1")
    elif estimator == "k2":
        kl = 0.5 * (logprobs - ref_logprobs) ** 2
    else:  # "k3" / "low_var_kl"
        log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
        kl = torch.clamp(_k3_of_log_ratio(log_ratio), min=-10.0, max=10.0)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


# --------------------------------------------------------------------------- policy loss
def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    tis_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token, with DAPO's decoupled clip range ("clip-higher"):

        ratio_t = exp(logp_t - logp_old_t)
        loss_t  = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high)) * w_t

    with w = `tis_weights` (truncated importance-sampling weights for the rollout engine's
    sampling mismatch, already capped, see `truncated_is_weights`) or 1. A raised `clip_high`
    lets low-probability tokens with A > 0 grow further (DAPO: 0.28 with clip_low 0.2).

    Returns `(loss_mat [B, T], stats)`: the loss matrix is 0 at masked positions and is reduced by
    the caller with `aggregate_loss` (with the step's global denominator). The log-ratio is
    clamped to [-20, 20] before exp, as veRL does. Stats are detached 0-dim tensors, masked means
    over tokens (no host sync, all-reducible):
        clipfrac       tokens where the clipped term was chosen (no gradient through them)
        clipfrac_high  ... of which ratio > 1 + clip_high with A > 0
        clipfrac_low   ... of which ratio < 1 - clip_low with A < 0
        approx_kl      k3 estimate of KL(old || new), (ratio - 1) - log ratio
        ratio_mean     mean ratio
        pg_loss        this batch's loss under `agg`, with its own denominator (for logging)
    """
    _check_mode(agg)
    keep = mask.bool()
    zero = torch.zeros_like(logprobs)
    # Sanitise before exp: padding may hold -inf log-probs and NaN advantages.
    log_ratio = torch.clamp(torch.where(keep, logprobs - old_logprobs, zero), min=-20.0, max=20.0)
    advantages = torch.where(keep, advantages, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if tis_weights is not None:
        loss_mat = loss_mat * torch.where(keep, tis_weights, zero)
    loss_mat = torch.where(keep, loss_mat, zero)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), keep),
            "clipfrac_high": masked_mean(
                ((ratio > 1.0 + clip_high) & (advantages > 0)).to(ratio.dtype), keep
            ),
            "clipfrac_low": masked_mean(
                ((ratio < 1.0 - clip_low) & (advantages < 0)).to(ratio.dtype), keep
            ),
            "approx_kl": masked_mean(_k3_of_log_ratio(log_ratio), keep),
            "ratio_mean": masked_mean(ratio, keep),
            "pg_loss": aggregate_loss(loss_mat, keep, agg),
        }
    return loss_mat, stats


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance-sampling weights `[B, T]`: min(pi_old / pi_behaviour, cap), 0 masked.

    pi_behaviour is the policy that actually sampled the tokens (the inference engine's log-probs),
    pi_old the trainer's recomputation of the same weights; their mismatch (kernels, precision,
    stale weights) biases the update, and the capped ratio corrects it with bounded variance.
    Computed as exp(min(log ratio, log cap)), so no overflow. No gradient (fixed weights).
    """
    if not cap > 0:
        raise ValueError(f"truncated importance sampling cap must be > 0, got {cap}")
    keep = mask.bool()
    zero = torch.zeros_like(old_logprobs)
    log_ratio = torch.where(keep, old_logprobs - behaviour_logprobs, zero)
    weights = torch.exp(torch.clamp(log_ratio, max=math.log(cap)))
    return torch.where(keep, weights, zero)


# --------------------------------------------------------------------------- entropy
def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension, `[..., V]` -> `[...]` (>= float32).

        H = logsumexp(z) - sum_v softmax(z)_v * z_v

    (= -sum p log p without forming log p; veRL's formula, here after shifting the row's max
    logit to 0.) Logits of
    -inf (masked vocabulary) contribute 0 and no NaN gradient. bf16/fp16 logits are upcast, so
    this materialises a float32 `[..., V]` copy: call it per micro-batch.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    # H is shift-invariant; shifting the max to 0 keeps logsumexp and sum(p * z) small, so their
    # difference loses no digits when the logits are large (1e4 in float32 would lose ~4e-4).
    top = logits.amax(dim=-1, keepdim=True).detach()
    logits = logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.softmax(logits, dim=-1)
    finite_logits = torch.where(probs > 0, logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)


__all__ = [
    "KL_DIVERGENCE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "aggregation_weights",
    "clipped_policy_loss",
    "entropy_from_logits",
    "kl_divergence",
    "loss_denominator",
    "truncated_is_weights",
]
