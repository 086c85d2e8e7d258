"""Advantage estimators for RLHF, one function per paper, in the papers' names.

    gae_advantages           PPO (Schulman et al. 2016), per token, needs a critic
    grpo_advantages          GRPO (Shao et al. 2024, DeepSeekMath); norm_by_std=False is Dr. GRPO
                             (Liu et al. 2025, "Understanding R1-Zero-Like Training")
    rloo_advantages          RLOO (Ahmadian et al. 2024, "Back to Basics")
    reinforce_pp_advantages  REINFORCE++ (Hu 2025); with group_ids: REINFORCE++-baseline
    overlong_reward_penalty, dynamic_sampling_keep
                             DAPO (Yu et al. 2025): soft overlong punishment, dynamic sampling

Conventions are those of `ppo_math`: per-token tensors are `[B, T]` over action positions with a
`mask`; masked positions are selected away with `torch.where` (padding may hold NaN / -inf), and a
reduction over nothing is 0, not NaN. Per-sample tensors are `[B]`.

Groups. `group_ids` is a `[B]` integer tensor naming each sample's prompt (e.g. `sample_index //
samples_per_prompt`). Ids need not be contiguous or sorted. Every group must be complete in the
call: a group split over two data-parallel ranks would get two different baselines.

Outcome estimators (GRPO, RLOO) return one advantage per sample, `[B]`; `outcome_to_tokens`
broadcasts it over the sample's action tokens. All estimators run under `torch.no_grad()`:
advantages are fixed targets, never differentiated through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_orch.algo.options import GRPOConfig, ReinforcePPConfig
from rlhf_orch.algo.ppo_math import WHITEN_EPS, token_rewards


# --------------------------------------------------------------------------- GAE (PPO)
@torch.no_grad()  # advantages and returns are fixed targets, never differentiated through
def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the real tokens of each row, in reverse time.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t

    The "next" step of a real token is the next *real* token of the same row, so masked positions
    -- right padding, leading prompt positions, or holes -- are skipped and never leak. After a
    row's last real token the episode ends: V = 0 and A = 0 there. Masked outputs are 0.

    With `values = 0` and `lam = 1` this is the discounted return-to-go, sum_k gamma^k r_{t+k}
    (used by REINFORCE++ below).
    """
    keep = mask.bool()
    batch, steps = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(steps)):
        real = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # Only real tokens move the recursion; masked ones are transparent.
        next_advantage = torch.where(real, advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = torch.where(real, advantage, torch.zeros_like(advantage))
    returns = torch.where(keep, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


# --------------------------------------------------------------------------- group statistics
def _as_float(scores: Tensor) -> Tensor:
    return scores if scores.is_floating_point() else scores.float()


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per sample: its score minus its group's mean, its group's size k, the group's unbiased std,
    and whether all of the group's scores are equal (a group of one included).

    Vectorised: `torch.unique(return_inverse=True)` maps arbitrary ids to 0..G-1, and the per-group
    sums are `index_add_`s -- no Python loop over groups. A group whose scores are all equal
    (including a group of one) gets centred scores of exactly 0, not the rounding error of
    `x - mean(x)`, so it contributes exactly nothing. The std is torch.std's (Bessel-corrected,
    divide by k - 1), as veRL's GRPO uses; a group of one has std 0.
    """
    if group_ids.shape != scores.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    scores = _as_float(scores)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    k = counts.to(scores.dtype)
    mean = scores.new_zeros(n_groups).index_add_(0, inverse, scores) / k
    # Exactly-constant groups: max == min.
    inf = scores.new_full((n_groups,), float("inf"))
    group_min = inf.scatter_reduce(0, inverse, scores, "amin")
    group_max = (-inf).scatter_reduce(0, inverse, scores, "amax")
    constant = (group_max == group_min)[inverse]
    centred = torch.where(constant, torch.zeros_like(scores), scores - mean[inverse])
    sq = scores.new_zeros(n_groups).index_add_(0, inverse, centred**2)
    std = torch.sqrt(sq / (k - 1.0).clamp(min=1.0))
    return centred, k[inverse], std[inverse], constant


@torch.no_grad()
def grpo_advantages(scores: Tensor, group_ids: Tensor, norm_by_std: bool = True, eps: float = GRPOConfig.eps) -> Tensor:
    """GRPO's outcome advantage, one per sample `[B]`:

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     (GRPO)
        A_i =  r_i - mean(r_group)                             (Dr. GRPO: norm_by_std=False)

    std is the unbiased (Bessel) sample std, as torch.std and veRL's
    `compute_grpo_outcome_advantage`. A group of equal rewards -> exactly 0. A group of one -> 0
    (it has no baseline to compare with; veRL instead gives it `r / (1 + eps)`, mean 0 std 1).
    """
    centred, _, std, constant = _group_stats(scores, group_ids)
    if not norm_by_std:
        return centred
    # A constant group's centred scores are exactly 0; keep them 0 even with eps = 0 (no 0/0).
    return centred / torch.where(constant, torch.ones_like(std), std + eps)


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO's leave-one-out advantage, one per sample `[B]`:

        A_i = r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean(r_group))

    for a group of k > 1 samples (the second form is veRL's `compute_rloo_outcome_advantage`).
    A group of one has no other sample to compare with -> 0 (veRL leaves its raw score there).
    """
    centred, k, _, _ = _group_stats(scores, group_ids)
    return torch.where(k > 1, centred * k / (k - 1.0).clamp(min=1.0), torch.zeros_like(centred))


def outcome_to_tokens(adv_per_sample: Tensor, mask: Tensor) -> Tensor:
    """Broadcast a per-sample advantage `[B]` to its action tokens `[B, T]` (0 elsewhere)."""
    per_token = adv_per_sample.unsqueeze(-1).expand(mask.shape)
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token))


def distill_advantages(old_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """On-policy distillation's per-token advantage: coef * (log pi_teacher(y_t) - log pi_old(y_t))
    on action tokens, 0 elsewhere -- the negative single-sample estimate of the reverse KL
    KL(pi || pi_teacher) at token t, undiscounted (each token answers for itself only)."""
    m = mask.bool()
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    # (torch.where: a padded position's -inf or NaN never reaches the product)
    return torch.where(m, coef * (teacher_logprobs - old_logprobs), zero)


# --------------------------------------------------------------------------- split whitening
def masked_moments(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(sum, sum of squares, count)` of `x` over the masked positions, as float64 0-dim tensors.

    The additive half of whitening: moments of several batches (micro-batches, data-parallel
    ranks) add up, so a caller can `all_reduce(SUM)` them -- e.g. stacked in one tensor -- and
    whiten every rank's tokens with the global statistics via `whiten_with_moments`. float64
    keeps `sum_sq / n - mean^2` clear of the cancellation float32 would suffer when |mean| >> std.
    """
    keep = mask.bool()
    x64 = torch.where(keep, x, torch.zeros_like(x)).double()
    return x64.sum(), (x64 * x64).sum(), keep.sum().double()


def whiten_with_moments(
    x: Tensor,
    mask: Tensor,
    total_sum: Tensor | float,
    total_sum_sq: Tensor | float,
    total_count: Tensor | float,
    eps: float = WHITEN_EPS,
    shift_mean: bool = True,
) -> Tensor:
    """Whiten `x` with the mean and variance implied by (already reduced) moments.

        mean = S / n,  var = (S2 / n - mean^2) * n / (n - 1),  out = (x - mean) / sqrt(var + eps)

    The variance is Bessel-corrected (n - 1) and falls back to / n for n <= 1, exactly as
    `ppo_math.masked_var`, so with one rank's own moments this reproduces
    `ppo_math.masked_whiten(x, mask, shift_mean, eps)` (and veRL's `masked_whiten`, also unbiased).
    `shift_mean=False` adds the mean back. Masked positions come back as 0. Same dtype as `x`.
    """
    keep = mask.bool()
    s = torch.as_tensor(total_sum, dtype=torch.float64, device=x.device)
    s2 = torch.as_tensor(total_sum_sq, dtype=torch.float64, device=x.device)
    n = torch.as_tensor(total_count, dtype=torch.float64, device=x.device)
    n_safe = n.clamp(min=1.0)
    mean = s / n_safe
    biased_var = (s2 / n_safe - mean * mean).clamp(min=0.0)  # clamp: rounding can go below 0
    var = torch.where(n > 1, biased_var * n / (n - 1.0).clamp(min=1.0), biased_var)
    x64 = torch.where(keep, x, torch.zeros_like(x)).double()
    whitened = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, torch.zeros_like(whitened)).to(x.dtype)


# --------------------------------------------------------------------------- REINFORCE++
@torch.no_grad()
def reinforce_pp_returns(
    scores: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float | None = None,
    gamma: float = ReinforcePPConfig.gamma,
    group_ids: Tensor | None = None,
    placed: Tensor | None = None,
) -> Tensor:
    """REINFORCE++'s un-whitened per-token returns `[B, T]` (the part before global whitening).

    1. With `group_ids` (REINFORCE++-baseline): r_i <- r_i - mean(r_group) (a group of one -> 0).
       With `placed` rewards the baseline goes with the rest of the score on the last token, so
       (gamma = 1) each token's return is its return-to-go minus the group's mean score: a group of
       equal totals still tells a turn rewarded early from one rewarded late.
    2. Token rewards: the score at each row's last real token, minus `kl_coef * kl` at every real
       token (`ppo_math.token_rewards`; `kl` is the per-token KL to the reference, e.g.
       `losses.kl_divergence(..., "k1")`, and may hold garbage at masked positions). `placed`:
       per-turn rewards kept at their tokens, the rest of the score at the last one.
    3. Discounted return-to-go along each row, G_t = sum_k gamma^k r_{t+k} over real tokens
       (`gae_advantages` with V = 0, lam = 1; masked positions are skipped and come back 0).
    """
    scores = _as_float(scores)
    if group_ids is not None:
        scores, _, _, _ = _group_stats(scores, group_ids)
    if kl is None:
        kl, kl_coef = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device), 0.0
    elif kl_coef is None:
        raise ValueError("reinforce_pp_returns: a kl needs its kl_coef")
    rewards = token_rewards(scores, kl, mask, kl_coef, placed)
    returns, _ = gae_advantages(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return returns


@torch.no_grad()
def reinforce_pp_advantages(
    scores: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float | None = None,
    gamma: float = ReinforcePPConfig.gamma,
    group_ids: Tensor | None = None,
    eps: float = WHITEN_EPS,
    placed: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ advantages `[B, T]`: `reinforce_pp_returns` whitened over the batch's tokens.

    Whitening (mean and unbiased std) spans the GLOBAL batch's masked tokens. This function uses
    the moments of its own batch (one rank). Over several data-parallel ranks, do instead:

        returns = reinforce_pp_returns(scores, mask, kl, kl_coef, gamma, group_ids)
        moments = torch.stack(masked_moments(returns, mask)); all_reduce(moments, SUM)
        advantages = whiten_with_moments(returns, mask, *moments, eps=eps)

    `group_ids` selects the REINFORCE++-baseline variant (as OpenRLHF's "reinforce_baseline" and
    veRL's "reinforce_plus_plus_baseline"): group-mean-subtracted scores, then the same steps.
    """
    returns = reinforce_pp_returns(scores, mask, kl, kl_coef, gamma, group_ids, placed)
    return whiten_with_moments(returns, mask, *masked_moments(returns, mask), eps=eps)


# --------------------------------------------------------------------------- DAPO
def overlong_reward_penalty(
    response_lens: Tensor, max_response_len: int, overlong_buffer: int, overlong_penalty: float
) -> Tensor:
    """DAPO's soft overlong punishment (paper eq. 13, scaled by `overlong_penalty`), `[B]` float:

        0                                                   if len <= max - buffer
        ((max - buffer) - len) / buffer * overlong_penalty  if max - buffer < len <= max
        -overlong_penalty                                   if len > max

    Added to the task score. veRL's DAPO reward manager (`overlong_buffer_cfg`: len, penalty_factor)
    computes `min(-(len - (max - buffer)) / buffer * penalty_factor, 0)` with no lower bound, which
    is the same for len <= max -- the only lengths its generation produces. With buffer 0 the
    penalty is a step: 0 up to max, -penalty beyond.
    """
    if not 0 <= overlong_buffer <= max_response_len:
        raise ValueError(f"overlong_buffer={overlong_buffer} must be between 0 and max_response_len={max_response_len}")
    lens = response_lens.to(torch.float32)
    expected = float(max_response_len - overlong_buffer)
    if overlong_buffer > 0:
        fraction = ((lens - expected) / overlong_buffer).clamp(min=0.0, max=1.0)
    else:
        fraction = (lens > max_response_len).to(torch.float32)
    return -overlong_penalty * fraction


@torch.no_grad()
def dynamic_sampling_keep(scores: Tensor, group_ids: Tensor, keep_singletons: bool = False) -> Tensor:
    """DAPO's dynamic-sampling filter: True for samples of groups whose scores are not all equal.

    A group whose samples all scored the same (all right, all wrong) has advantage 0 everywhere
    under GRPO/RLOO and contributes no gradient; DAPO drops it and samples more prompts. "Not all
    equal" is tested exactly (max > min), i.e. std > 0. A group of one is dropped too, since its
    advantage here is 0; `keep_singletons=True` keeps it as veRL's DAPO trainer does
    (`std > 0 or len == 1`, for veRL's GRPO gives a singleton a non-zero advantage).
    """
    _, k, _, constant = _group_stats(scores, group_ids)
    keep = ~constant
    if keep_singletons:
        keep = keep | (k == 1)
    return keep


__all__ = [
    "dynamic_sampling_keep",
    "gae_advantages",
    "grpo_advantages",
    "masked_moments",
    "outcome_to_tokens",
    "overlong_reward_penalty",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "whiten_with_moments",
]
