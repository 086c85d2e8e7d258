"""Token-level primitives every RL estimator and loss is written with (after CleanRL's `ppo.py`).

Masked reductions, the per-token reward of a sequence score, and log-probs from logits. The
formulas built on them have one home each: advantage estimators in `advantages`, losses, KL
estimators and loss aggregation in `losses`; `rlhf_orch.algo.oracle` is the one-update
specification they are checked against. This module imports neither (no circle).

Conventions
-----------
Every per-token tensor is `[B, T]` over *action positions*: entry `t` belongs to the prediction of
one response token. `mask` (`[B, T]`, bool or 0/1 of any dtype) is 1 where that position is a real
response token and 0 elsewhere -- right padding, and also leading prompt positions when the caller
passes a full `[B, L-1]` layout (see `rlhf_orch.transfer.batch.PaddedBatch.action_mask`).

Every reduction is masked, and masked positions are *selected away* (`torch.where`), never
multiplied by 0: padding may hold garbage (`-inf` log-probs, NaN values) and `nan * 0` is NaN.
Inputs are sanitised before any `exp`, so no NaN/inf can leak into gradients either.

A reduction over zero real tokens (an all-padding micro-batch, an empty response) is defined as 0,
not NaN: such a micro-batch still runs a backward pass (so data-parallel ranks stay in lockstep)
and must contribute nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from rlhf_orch.algo.vocab_reductions import PLAIN_TEMPERATURE, Temperature, token_logprobs

# Added to the variance before dividing by its root (whitening): keeps a constant batch finite.
WHITEN_EPS = 1e-8

# |engine log-prob - trainer log-prob| above which a token counts in rollout/logprob_diff_over_frac:
# a 10 % disagreement on the token's probability (float32 kernels stay far below it; bfloat16's
# rounding crosses it on some tokens of a 30-layer model).
LOGPROB_DIFF_THRESHOLD = 0.1


# --------------------------------------------------------------------------- masked reductions
def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is set (over `dim`, or over everything).

    Zero selected positions give 0 (not NaN), see the module docstring.
    """
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x))
    count = keep.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1.0)
    return total.sum(dim) / count.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over the masked positions (Bessel-corrected when `unbiased` and n > 1)."""
    keep = mask.bool()
    mean = masked_mean(x, keep)
    centred_sq = torch.where(keep, (x - mean) ** 2, torch.zeros_like(x))
    n = keep.sum().to(x.dtype)
    # Bessel's correction as in torch.std / TRL; undefined for n <= 1, where we fall back to /n.
    # (torch.where rather than `if n > 1` so no host sync is forced on a GPU.)
    denom = torch.where(n > 1, n - 1.0, n.clamp(min=1.0)) if unbiased else n.clamp(min=1.0)
    return centred_sq.sum() / denom


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """Normalise `x` to unit variance over the masked positions (and zero mean if `shift_mean`).

    `shift_mean=False` keeps the original mean -- used for rewards, whose sign carries meaning.
    Masked-out positions come back as 0 so padding stays inert downstream.
    """
    keep = mask.bool()
    mean = masked_mean(x, keep)
    var = masked_var(x, keep)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- rewards
def last_token_onehot(mask: Tensor) -> Tensor:
    """Bool `[B, T]`, True at each row's last masked position; an all-zero row has none."""
    keep = mask.bool()
    positions = torch.arange(keep.shape[-1], device=keep.device).expand_as(keep)
    # Highest masked position per row; rows with no masked position get -1 and so match nothing.
    last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    return positions == last


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float, placed: Tensor | None = None) -> Tensor:
    """Per-token rewards: `-kl_coef * kl` everywhere, plus the sequence score at its last token.

    `placed` (`[B, T]`, optional): rewards that belong to positions inside the sequence (a
    multi-turn trajectory's per-turn rewards, `env.reward=per_turn`) stay where they are, and
    only the rest of the score (`score - sum(placed)`: the reward group's share, or what an
    estimator's baseline took off) goes on the last token, so a row's rewards still sum to its
    score (minus the KL penalty). Placed values on masked positions are not counted as placed.

    A row with no real token (an empty response) has no action to credit, so its score is
    dropped here (it still counts in reward statistics computed from `scores`).
    """
    keep = mask.bool()
    penalty = torch.where(keep, -kl_coef * kl, torch.zeros_like(kl))
    at_last = last_token_onehot(keep)
    last_share = scores.to(penalty.dtype)
    if placed is not None:
        placed = torch.where(keep, placed.to(penalty.dtype), torch.zeros_like(penalty))
        penalty = penalty + placed
        last_share = last_share - placed.sum(-1)
    return penalty + at_last.to(penalty.dtype) * last_share.unsqueeze(-1)


# --------------------------------------------------------------------------- log-probs
def logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: Temperature = PLAIN_TEMPERATURE,
    max_chunk_elements: int = 1 << 24,
) -> Tensor:
    """`log softmax(logits / temperature)[token]` for every position: `[..., V]`, `[...]` -> `[...]`.

    Works for padded (`[B, L, V]`, `[B, L]`) and packed (`[N, V]`, `[N]`) layouts; the caller does
    the next-token shift. Computed as `logit[token] - logsumexp(logits)` in float32 over chunks of
    rows, so no full `[..., V]` log-softmax (nor a full float32 copy of bf16 logits) is ever
    materialised at once -- the peak extra memory is one chunk of `max_chunk_elements` floats, and
    the backward keeps only the logits and two floats per row (`vocab_reductions.token_logprobs`).
    `temperature` must match the sampling temperature for these to be comparable with the engine's
    log-probs: one for all, or per position (`[...]`, tokens sampled at different ones).
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree: "
            "tokens must match logits without the vocabulary dimension"
        )
    return token_logprobs(logits, tokens, temperature, max_chunk_elements)
