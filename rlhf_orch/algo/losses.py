"""The losses of every algorithm -- policy (PPO clip, clip-higher, dual clip, TIS, AReaL's
decoupled PPO weights), value, KL, entropy -- and how a per-token loss becomes the scalar that is back-propagated.

Each loss returns a per-token loss matrix shaped like its mask (`[B, T]` rows, or a packed `[N]`
with the batch's `sequence_ids`; 0 at masked positions); turning it into the
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

(`aggregation_weights` gives w, `loss_denominator` gives D; "sequences" are the rows of a `[B, T]`
mask, or the groups of `sequence_ids` of a packed one, with at least one action token.) w is
per-sequence, D is global. So when the batch of one optimizer step is cut
into micro-batches and spread over data-parallel ranks, the caller:

    1. before the step, sums `loss_denominator(mb.action_mask, mode, norm_len, mb.sequence_ids)` over this rank's
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

from rlhf_orch.algo.ppo_math import masked_mean
from rlhf_orch.algo.vocab_reductions import PLAIN_TEMPERATURE, Temperature, entropy as vocab_entropy
from rlhf_orch.algo.options import KL_DIVERGENCE_ESTIMATORS, LOSS_AGGREGATIONS, AlgoConfig


# --------------------------------------------------------------------------- loss aggregation


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is not known; allowed values: {list(LOSS_AGGREGATIONS)}")


def _sequence_tokens(keep: Tensor, mode: str, sequence_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """(action tokens of each position's sequence, shaped like `keep`; sequences with >= 1 of them).

    Without `sequence_ids` the rows of a `[B, T]` mask are the sequences. A flat `[N]` mask (the
    packed layout) holds many sequences in its one row, so it must say which token is whose: a
    seq-mean over it without `sequence_ids` would count the whole micro-batch as one sequence.
    """
    if sequence_ids is None:
        if keep.dim() < 2 and mode != "token-mean":
            raise ValueError(
                f"loss aggregation {mode!r} over a flat (packed) mask needs sequence_ids "
                "(the batch's `sequence_ids`): its one row holds many sequences"
            )
        counts = keep.sum(dim=-1, keepdim=True)
        return counts.expand_as(keep), (counts > 0).sum()
    if sequence_ids.shape != keep.shape:
        raise ValueError(f"sequence_ids {tuple(sequence_ids.shape)} must be shaped like the mask {tuple(keep.shape)}")
    ids = sequence_ids.reshape(-1).long()
    if ids.numel() == 0:
        zero = keep.new_zeros((), dtype=torch.long)
        return keep.to(torch.long), zero
    counts = torch.bincount(ids, weights=keep.reshape(-1).to(torch.float64)).round().long()
    return counts[ids].view(keep.shape), (counts > 0).sum()


def aggregation_weights(
    mask: Tensor, mode: str, dtype: torch.dtype = torch.float32, sequence_ids: Tensor | None = None
) -> Tensor:
    """Per-token weights w (shaped like `mask`) of `mode` (see the module docstring); 0 masked.

    Only "seq-mean-token-mean" weights tokens unequally: 1 / (action tokens of the token's
    sequence), so that every sequence counts once whatever its length (GRPO's original 1/|o_i|,
    whose length bias Dr. GRPO removes). `sequence_ids`: see `loss_denominator`.
    """
    _check_mode(mode)
    keep = mask.bool()
    w = keep.to(dtype)
    if mode == "seq-mean-token-mean":
        tokens, _ = _sequence_tokens(keep, mode, sequence_ids)
        w = w / tokens.to(dtype).clamp(min=1.0)
    return w


def loss_denominator(
    mask: Tensor, mode: str, norm_len: int | None = None, sequence_ids: Tensor | None = None
) -> Tensor:
    """This batch's contribution D to the normaliser of `mode`, a float32 0-dim tensor.

    Additive over micro-batches and ranks: sum it over every micro-batch of an optimizer step on
    all ranks and pass the total to `aggregate_loss(..., denominator=)`.

        token-mean                number of action tokens
        seq-mean-token-*          number of sequences with at least one action token
        seq-mean-token-sum-norm   that number of sequences * norm_len

    Sequences are the rows of a `[B, T]` mask, or, for a flat packed `[N]` mask, the groups of
    `sequence_ids` (`[N]`, each token's sequence: `PackedBatch.sequence_ids`), which may be given
    for a `[B, T]` mask too (`PaddedBatch.sequence_ids`).

    `norm_len` (default: `mask.shape[-1]` of a `[B, T]` mask) is Dr. GRPO's constant normaliser,
    MAX_TOKENS: the generation budget (max response length), the same for every sequence and
    every step so no sequence's tokens weigh more for being short. Pass it explicitly -- the
    default, the padded width, varies between micro-batches, and a packed layout has none.
    """
    _check_mode(mode)
    keep = mask.bool()
    if mode == "token-mean":
        return keep.sum().to(torch.float32)
    _, sequences = _sequence_tokens(keep, mode, sequence_ids)
    sequences = sequences.to(torch.float32)
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None and keep.dim() < 2:
            raise ValueError("seq-mean-token-sum-norm over a flat (packed) mask needs norm_len")
        return sequences * float(mask.shape[-1] if norm_len is None else norm_len)
    return sequences


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    norm_len: int | None = None,
    denominator: Tensor | float | None = None,
    sequence_ids: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss (`[B, T]`, or packed `[N]` with `sequence_ids`) to a scalar:
    sum(mask * w * loss) / D (module docstring).

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
    w = aggregation_weights(keep, mode, loss_mat.dtype, sequence_ids)
    total = torch.where(keep, loss_mat * w, torch.zeros_like(loss_mat)).sum()
    if denominator is None:
        denominator = loss_denominator(keep, mode, norm_len, sequence_ids)
    d = torch.as_tensor(denominator, dtype=total.dtype, device=total.device)
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    return torch.where(d > 0, total / safe_d, torch.zeros_like(total))


# --------------------------------------------------------------------------- KL to the reference


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (input's shape).

        k1          logp - ref                                 unbiased, can be < 0
        k2          1/2 (logp - ref)^2                         biased, >= 0
        k3          e^d - d - 1 with d = ref - logp            unbiased, >= 0, low variance
        low_var_kl  = k3 (veRL's name); both clamp d to [-20, 20] before exp and the
                    estimate to [-10, 10], as veRL's `kl_penalty` does for them

    Where each belongs: k1 (and k2) as a penalty in the reward, `r_t -= coef * kl_t`
    (`ppo_math.token_rewards`), or in the loss; k3 belongs in the loss, `+ coef * kl_t` aggregated
    like the policy loss -- as a reward penalty its policy gradient is biased. This is the
    documented default split: `kl_placement` "in_reward" with k1, "in_loss" with low_var_kl.

    `mask` (optional): masked positions are sanitised before any arithmetic and come back 0, so
    padding holding -inf cannot put NaN into gradients. Without it, padding values pass through.
    """
    if estimator not in KL_DIVERGENCE_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not known; allowed values: {list(KL_DIVERGENCE_ESTIMATORS)}")
    if mask is not None:
        keep = mask.bool()
        zero = torch.zeros_like(logprobs)
        logprobs = torch.where(keep, logprobs, zero)
        ref_logprobs = torch.where(keep, ref_logprobs, zero)
    if estimator == "k1":
        kl = logprobs - ref_logprobs
    elif estimator == "k2":
        kl = 0.5 * (logprobs - ref_logprobs) ** 2
    else:  # "k3" / "low_var_kl": Schulman's r - log r - 1 with r = pi_ref / pi
        d = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
        kl = torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


# --------------------------------------------------------------------------- policy loss
def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = AlgoConfig.clip_low,
    clip_high: float = AlgoConfig.clip_high,
    agg: str = "token-mean",
    is_weights: Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token, with DAPO's decoupled clip range ("clip-higher") and
    dual-clip PPO (Ye et al. 2020) for negative advantages:

        ratio_t = exp(logp_t - logp_old_t)
        l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        l_t     = min(l_t, -A_t * clip_ratio_c)          where A_t < 0 (dual clip, when set)
        loss_t  = l_t * w_t

    with w = `is_weights`, the per-token importance weights that correct for the rollout engine
    sampling with another policy than pi_old (fixed, computed by the caller: truncated IS,
    `truncated_is_weights`, or AReaL's decoupled PPO, `decoupled_is_weights`, 0 for a dropped
    token) or 1. A raised `clip_high`
    lets low-probability tokens with A > 0 grow further (DAPO: 0.28 with clip_low 0.2). The dual
    clip (`clip_ratio_c` > 1, veRL's and OpenRLHF's default 3) bounds the loss of a token with
    A < 0 whose ratio exploded, which the plain max leaves unbounded.

    Returns `(loss_mat, stats)`: the loss matrix is 0 at masked positions and is reduced by
    the caller with `aggregate_loss` (with the step's global denominator). The log-ratio is
    clamped to [-20, 20] before exp, as veRL does. Stats are detached 0-dim tensors, masked means
    over tokens (no host sync, all-reducible):
        clipfrac       tokens where the clipped term was chosen (no gradient through them)
        clipfrac_high  ... of which ratio > 1 + clip_high with A > 0
        clipfrac_low   ... of which ratio < 1 - clip_low with A < 0
        clipfrac_dual  tokens with A < 0 where the dual clip bound (only with clip_ratio_c)
        approx_kl      k3 estimate of KL(old || new), (ratio - 1) - log ratio
        ratio_mean     mean ratio
    """
    _check_mode(agg)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    keep = mask.bool()
    zero = torch.zeros_like(logprobs)
    # Sanitise before exp: padding may hold -inf log-probs and NaN advantages.
    log_ratio = torch.clamp(torch.where(keep, logprobs - old_logprobs, zero), min=-20.0, max=20.0)
    advantages = torch.where(keep, advantages, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual = None
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, bound), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * torch.where(keep, is_weights, zero)
    loss_mat = torch.where(keep, loss_mat, zero)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), keep),
            "clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).to(ratio.dtype), keep),
            "clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).to(ratio.dtype), keep),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, keep),
            "ratio_mean": masked_mean(ratio, keep),
        }
        if dual is not None:
            stats["clipfrac_dual"] = masked_mean(dual.to(ratio.dtype), keep)
    return loss_mat, stats


# --------------------------------------------------------------------------- value loss
def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss per token: `0.5 * max((V - R)^2, (V_clip - R)^2)`, 0 masked.

    `V_clip = clip(V, V_old - eps, V_old + eps)` keeps the critic from moving far from the values
    the advantages were computed with. (Clamping V itself, not `V_old + clip(V - V_old)`, makes
    V_clip == V bit for bit inside the range, so no rounding tie counts as clipped.) Reduced by the
    caller with `aggregate_loss` (token-mean). Stat `vf_clipfrac`: fraction of tokens where the
    clipped term was the larger one (detached 0-dim tensor).
    """
    keep = mask.bool()
    zero = torch.zeros_like(values)
    values = torch.where(keep, values, zero)
    old_values = torch.where(keep, old_values, zero)
    returns = torch.where(keep, returns, zero)
    values_clipped = torch.clamp(values, old_values - clip_eps, old_values + clip_eps)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (values_clipped - returns) ** 2
    loss_mat = torch.where(keep, 0.5 * torch.maximum(unclipped_sq, clipped_sq), zero)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped_sq > unclipped_sq).to(values.dtype), keep)}
    return loss_mat, stats


@torch.no_grad()
def truncated_is_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
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


@torch.no_grad()
def decoupled_is_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Behaviour importance weights `[B, T]` of AReaL's decoupled PPO objective (Fu et al. 2025):
    pi_prox / pi_behaviour where it is <= cap, 0 where it exceeds the cap and at masked positions.

    Rollouts sampled with stale weights (pipeline=one_step_off, async) come from a behaviour policy
    pi_behaviour (the engine's log-probs) other than the proximal policy pi_prox that the PPO clip
    is against (`old_logprobs`, the trainer's recomputation before this update). The decoupled
    objective keeps the clip against pi_prox and weights each token's loss by pi_prox /
    pi_behaviour, which turns the expectation over the engine's samples into one over pi_prox's.
    A token whose weight exceeds `cap` (AReaL's `behav_imp_weight_cap`, > 1; 5 in AReaL's
    examples) is dropped from the loss (weight 0), not truncated to the cap as by
    `truncated_is_weights`: a weight that large marks a sample too far off the proximal policy to
    correct with bounded variance, and a truncated one would still train on it. The cap is tested
    on the log-ratio and exp only sees values <= log(cap), so nothing overflows. No gradient
    (fixed weights).
    """
    if not cap > 1:
        raise ValueError(f"decoupled PPO's behaviour importance weight cap must be > 1, got {cap}")
    keep = mask.bool()
    zero = torch.zeros_like(old_logprobs)
    log_ratio = torch.where(keep, old_logprobs - behaviour_logprobs, zero)
    log_cap = math.log(cap)
    # A NaN log-ratio fails the comparison too, so it is dropped rather than leaked into the loss.
    kept = keep & (log_ratio <= log_cap)
    weights = torch.exp(torch.clamp(log_ratio, max=log_cap))
    return torch.where(kept, weights, zero)


# --------------------------------------------------------------------------- entropy
def entropy_from_logits(logits: Tensor, temperature: Temperature = PLAIN_TEMPERATURE) -> Tensor:
    """Entropy of softmax(logits / temperature) over the last dimension, `[..., V]` -> float32 `[...]`.

        H = logsumexp(z) - sum_v softmax(z)_v * z_v

    (= -sum p log p without forming log p; veRL's formula, after shifting the row's max logit to
    0.) Logits of -inf (masked vocabulary) contribute 0 and no NaN gradient. Chunked over rows in
    float32; the backward keeps only the logits and three floats per row
    (`vocab_reductions.entropy`), not float32 `[..., V]` copies.
    """
    return vocab_entropy(logits, temperature)


__all__ = [
    "KL_DIVERGENCE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "aggregation_weights",
    "clipped_policy_loss",
    "clipped_value_loss",
    "decoupled_is_weights",
    "entropy_from_logits",
    "kl_divergence",
    "loss_denominator",
    "truncated_is_weights",
]
