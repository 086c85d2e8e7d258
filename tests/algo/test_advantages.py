"""Advantage estimators against hand-computed numbers (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest
import torch

from rlhf_orch.algo.advantages import (
    dynamic_sampling_keep,
    grpo_advantages,
    masked_moments,
    outcome_to_tokens,
    overlong_reward_penalty,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten_with_moments,
)
from rlhf_orch.algo.ppo_math import masked_whiten

NAN, INF = float("nan"), float("inf")


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.long)


def close(actual, expected, atol=1e-6):
    expected = expected if torch.is_tensor(expected) else t(expected)
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------- GRPO / Dr. GRPO
def test_grpo_two_groups_by_hand():
    # group 0: r = [1, 0, 1, 1]  mean 0.75, r - mean = [0.25, -0.75, 0.25, 0.25]
    #          unbiased var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std = 0.5
    #          A = [0.5, -1.5, 0.5, 0.5]            (/(0.5 + 1e-6): off by 2e-6 relative)
    # group 1: r = [0, 0, 0, 1]  mean 0.25, r - mean = [-0.25, -0.25, -0.25, 0.75], std 0.5
    #          A = [-0.5, -0.5, -0.5, 1.5]
    scores = t([1, 0, 1, 1, 0, 0, 0, 1])
    groups = ids([0, 0, 0, 0, 1, 1, 1, 1])
    close(grpo_advantages(scores, groups), [0.5, -1.5, 0.5, 0.5, -0.5, -0.5, -0.5, 1.5], atol=1e-5)
    # eps = 0 gives the exact quotient
    close(grpo_advantages(scores, groups, eps=0.0), [0.5, -1.5, 0.5, 0.5, -0.5, -0.5, -0.5, 1.5])


def test_grpo_non_contiguous_group_ids():
    # The same two groups interleaved, with ids 7 and 3 (not 0..G-1, not sorted).
    scores = t([1, 0, 0, 0, 1, 0, 1, 1])
    groups = ids([7, 3, 7, 3, 7, 3, 7, 3])
    close(grpo_advantages(scores, groups, eps=0.0), [0.5, -0.5, -1.5, -0.5, 0.5, -0.5, 0.5, 1.5])


def test_dr_grpo_no_std():
    # norm_by_std=False: just r - mean of the group (the values from the first test, unscaled).
    scores = t([1, 0, 1, 1, 0, 0, 0, 1])
    groups = ids([0, 0, 0, 0, 1, 1, 1, 1])
    close(
        grpo_advantages(scores, groups, norm_by_std=False),
        [0.25, -0.75, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75],
    )


def test_grpo_equal_group_singleton_and_pair():
    # group 0: [0.3, 0.3, 0.3] all equal -> exactly 0 (mean 0.3 is inexact in float; still 0)
    # group 1: [5.0] alone -> 0, no NaN
    # group 2: [1, 3]: mean 2, devs [-1, 1], unbiased var = 2 / 1, std = 1.414214
    #          A = [-0.707107, 0.707107]
    scores = t([0.3, 0.3, 0.3, 5.0, 1.0, 3.0])
    groups = ids([0, 0, 0, 1, 2, 2])
    out = grpo_advantages(scores, groups, eps=0.0)
    assert torch.equal(out[:4], torch.zeros(4))
    close(out[4:], [-0.707107, 0.707107])
    assert torch.isfinite(grpo_advantages(t([5.0]), ids([0]))).all()
    assert torch.equal(grpo_advantages(t([5.0]), ids([0]), norm_by_std=False), torch.zeros(1))


def test_grpo_integer_scores_and_shape_check():
    close(grpo_advantages(torch.tensor([1, 0]), ids([0, 0]), eps=0.0), [0.707107, -0.707107])
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(t([1.0, 2.0]), ids([0, 0, 0]))


# --------------------------------------------------------------------------- RLOO
def test_rloo_by_hand():
    # group 0: [1, 0, 1, 1]: r_i - mean of the other three
    #   1 - (0 + 1 + 1)/3 = 1/3;  0 - (1 + 1 + 1)/3 = -1
    # group 1: [2, 4] (ids interleaved): 2 - 4 = -2, 4 - 2 = 2
    # group 2: [9] alone -> 0;  group 3: [0.3, 0.3, 0.3] -> 0
    scores = t([1, 2, 0, 4, 1, 1, 9, 0.3, 0.3, 0.3])
    groups = ids([10, 20, 10, 20, 10, 10, 30, 40, 40, 40])
    out = rloo_advantages(scores, groups)
    close(out, [1 / 3, -2.0, -1.0, 2.0, 1 / 3, 1 / 3, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(out[6:], torch.zeros(4))


def test_outcome_to_tokens():
    # Per-sample 2 and -1 over their action tokens; padding (mask 0) gets 0.
    mask = t([[0, 1, 1, 0], [1, 1, 1, 1]])
    close(outcome_to_tokens(t([2.0, -1.0]), mask), [[0, 2, 2, 0], [-1, -1, -1, -1]])


# --------------------------------------------------------------------------- split whitening
def test_whiten_with_moments_reproduces_masked_whiten():
    # masked_whiten uses the unbiased (n - 1) variance; whiten_with_moments must match it.
    # x = [1, 2, 3, 4] (pads NaN / +-99): mean 2.5, var 5/3, std 1.290994
    x = t([[1.0, 2.0, NAN], [3.0, 4.0, -99.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    s, s2, n = masked_moments(x, mask)
    close(s, t(10.0, torch.float64))
    close(n, t(4.0, torch.float64))
    close(s2, t(30.0, torch.float64))  # 1 + 4 + 9 + 16
    out = whiten_with_moments(x, mask, s, s2, n)
    close(out, [[-1.161895, -0.387298, 0.0], [0.387298, 1.161895, 0.0]])
    close(out, masked_whiten(x, mask))
    close(
        whiten_with_moments(x, mask, s, s2, n, shift_mean=False),
        masked_whiten(x, mask, shift_mean=False),
    )
    # Random data, including a large mean (the float64 moments keep the cancellation away).
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(5, 9, generator=gen) * 3.0 + 40.0
    m = torch.rand(5, 9, generator=gen) > 0.3
    close(whiten_with_moments(y, m, *masked_moments(y, m)), masked_whiten(y, m), atol=2e-5)


def test_whiten_with_moments_one_and_zero_tokens():
    # n = 1: var falls back to /n = 0 -> (x - x) * rsqrt(eps) = 0, as masked_whiten.
    x = t([[7.0, NAN]])
    one = t([[1, 0]])
    close(whiten_with_moments(x, one, *masked_moments(x, one)), [[0.0, 0.0]])
    close(masked_whiten(x, one), [[0.0, 0.0]])
    none = torch.zeros(1, 2)
    close(whiten_with_moments(x, none, *masked_moments(x, none)), [[0.0, 0.0]])


def test_split_moments_over_two_ranks_equal_whitening_of_concatenation():
    gen = torch.Generator().manual_seed(1)
    rank_a = torch.randn(2, 3, generator=gen)
    mask_a = t([[1, 1, 0], [1, 1, 1]])
    rank_b = torch.randn(3, 5, generator=gen)
    mask_b = t([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]])
    rank_a = torch.where(mask_a.bool(), rank_a, torch.full_like(rank_a, NAN))  # garbage pads
    # "all_reduce": the moments add.
    moments = torch.stack(masked_moments(rank_a, mask_a))
    moments = moments + torch.stack(masked_moments(rank_b, mask_b))
    out_a = whiten_with_moments(rank_a, mask_a, *moments)
    out_b = whiten_with_moments(rank_b, mask_b, *moments)
    # The concatenated batch, rank A right-padded to width 5.
    full = torch.cat([torch.cat([rank_a, torch.full((2, 2), NAN)], 1), rank_b])
    full_mask = torch.cat([torch.cat([mask_a, torch.zeros(2, 2)], 1), mask_b])
    expected = masked_whiten(full, full_mask)
    close(out_a, expected[:2, :3])
    close(out_b, expected[2:])


# --------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_kl_masked_tokens_by_hand():
    # kl_coef = 0.5, gamma = 1; pads hold NaN / inf KL, which must not leak.
    # row 0 (3 real): rewards [-0.05, -0.1, -0.15 + 1] = [-0.05, -0.1, 0.85]
    #                 returns-to-go [0.70, 0.75, 0.85]
    # row 1 (2 real): rewards [-0.25, 0.25 - 1] = [-0.25, -0.75]; returns [-1.0, -0.75]
    # tokens [0.70, 0.75, 0.85, -1.0, -0.75]: mean 0.11, unbiased var 3.277 / 4 = 0.81925,
    #   std 0.905124; A = (x - 0.11) / 0.905124
    #   = [0.651844, 0.707085, 0.817567, -1.226351, -0.950146]
    scores = t([1.0, -1.0])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, NAN], [0.5, -0.5, INF, NAN]])
    returns = reinforce_pp_returns(scores, mask, kl=kl, kl_coef=0.5)
    close(returns, [[0.70, 0.75, 0.85, 0.0], [-1.0, -0.75, 0.0, 0.0]])
    out = reinforce_pp_advantages(scores, mask, kl=kl, kl_coef=0.5)
    assert torch.isfinite(out).all()
    close(out, [[0.651844, 0.707085, 0.817567, 0.0], [-1.226351, -0.950146, 0.0, 0.0]], atol=1e-5)


def test_reinforce_pp_gamma_below_one_and_prompt_positions():
    # gamma = 0.5, no KL, score 1 at the last of 3 real tokens (position 0 is a prompt position
    # with garbage mask 0): returns [0.25, 0.5, 1.0]
    # mean 0.583333, unbiased var 0.145833, std 0.381881 -> A = [-0.872872, -0.218218, 1.091089]
    scores = t([1.0])
    mask = t([[0, 1, 1, 1]])
    close(reinforce_pp_returns(scores, mask, gamma=0.5), [[0.0, 0.25, 0.5, 1.0]])
    close(
        reinforce_pp_advantages(scores, mask, gamma=0.5),
        [[0.0, -0.872872, -0.218218, 1.091089]],
        atol=1e-5,
    )


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # group 0: [1, 0, 1, 1] -> [0.25, -0.75, 0.25, 0.25]; group 1: [0, 1] -> [-0.5, 0.5]
    # gamma 1, no KL, 2 real tokens each: every token holds its row's centred score.
    # 12 tokens: mean 0, sum of squares 2 * (3 * 0.0625 + 0.5625 + 0.25 + 0.25) = 2.5,
    #   unbiased var 2.5 / 11 = 0.227273, std 0.476731
    # A: 0.25 -> 0.524404, -0.75 -> -1.573213, -/+0.5 -> -/+1.048809
    # (= veRL's reinforce_plus_plus_baseline: whiten(tile(r - group mean)))
    scores = t([1, 0, 1, 1, 0, 1])
    groups = ids([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 2)
    out = reinforce_pp_advantages(scores, mask, group_ids=groups)
    a, b, c = 0.524404, -1.573213, 1.048809
    close(out, [[a, a], [b, b], [a, a], [a, a], [-c, -c], [c, c]], atol=1e-5)
    # Without the baseline the same scores give different (uncentred-before-whitening) numbers.
    assert not torch.allclose(reinforce_pp_advantages(scores, mask), out)


def test_reinforce_pp_split_over_ranks_matches_one_batch():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(6, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    kl = torch.randn(6, 5, generator=gen)
    one_shot = reinforce_pp_advantages(scores, mask, kl=kl, kl_coef=0.1, gamma=0.9)
    parts = [slice(0, 2), slice(2, 6)]
    returns = [reinforce_pp_returns(scores[p], mask[p], kl[p], 0.1, 0.9) for p in parts]
    moments = sum(torch.stack(masked_moments(r, mask[p])) for r, p in zip(returns, parts))
    split = torch.cat([whiten_with_moments(r, mask[p], *moments) for r, p in zip(returns, parts)])
    close(split, one_shot, atol=1e-5)


# --------------------------------------------------------------------------- DAPO
def test_overlong_penalty_boundaries():
    # max 20, buffer 4 -> expected length 16; penalty 1:
    #   10 -> 0, 16 -> 0 (boundary), 17 -> (16 - 17)/4 = -0.25, 18 -> -0.5, 20 -> -1 (boundary),
    #   21, 30 -> -1 (beyond max)
    lens = ids([10, 16, 17, 18, 20, 21, 30])
    close(overlong_reward_penalty(lens, 20, 4, 1.0), [0, 0, -0.25, -0.5, -1, -1, -1])
    close(overlong_reward_penalty(lens, 20, 4, 0.5), [0, 0, -0.125, -0.25, -0.5, -0.5, -0.5])
    # buffer 0: a step at max
    close(overlong_reward_penalty(ids([19, 20, 21]), 20, 0, 1.0), [0, 0, -1])
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_reward_penalty(lens, 20, 21, 1.0)


def test_dynamic_sampling_keep():
    # group 5: [1, 1, 1] all equal -> drop; group 2: [0, 1] -> keep; group 9: [0.5, 0.5] -> drop;
    # group 4: [2] alone -> drop (kept only with keep_singletons, as veRL's DAPO trainer does)
    scores = t([1, 0, 1, 0.5, 1, 1, 0.5, 2])
    groups = ids([5, 2, 5, 9, 2, 5, 9, 4])
    keep = dynamic_sampling_keep(scores, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, False, False, True, False, False, False]
    assert dynamic_sampling_keep(scores, groups, keep_singletons=True).tolist() == [
        False,
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]


# --------------------------------------------------------------------------- the teacher's term
def test_distill_advantages_by_hand():
    """coef * (log pi_teacher - log pi_old) on action tokens: token 0: 0.5 * (-1.0 - -2.0) = 0.5;
    token 1: 0.5 * (-3.0 - -1.0) = -1.0; token 2 is masked out (its -inf never reaches the sum)."""
    from rlhf_orch.algo.advantages import distill_advantages

    old, teacher = t([[-2.0, -1.0, 0.0]]), t([[-1.0, -3.0, -INF]])
    adv = distill_advantages(old, teacher, t([[1, 1, 0]]), 0.5)
    assert adv.tolist() == [[0.5, -1.0, 0.0]]


def _rows(old, teacher, mask, sample_values):
    from rlhf_orch.algo.estimators import TargetRows

    return [
        TargetRows(mask=t(mask), sample_values=t(sample_values), old_logprobs=t(old), ref_logprobs=None, values=None,
                   teacher_logprobs=t(teacher))
    ]  # fmt: skip


def test_on_policy_distill_trains_on_the_teacher_term_alone():
    """algo=on_policy_distill: the score is not trained on (its sample value is 0 whatever the score),
    the advantage is the per-token log-ratio; another algorithm adds the term to its own."""
    from tests.conftest import compose_config
    from hydra.utils import instantiate

    distill = instantiate(compose_config(["algo=on_policy_distill", "teacher=tiny"]).algo)
    values, _ = distill.sample_values(t([1.0, 0.0]), ids([0, 0]), ids([2, 2]), 4)
    assert values.tolist() == [0.0, 0.0]
    old, teacher, mask = [[-2.0, -0.5], [-1.0, -1.0]], [[-1.0, -1.5], [-3.0, -1.0]], [[1, 1], [1, 0]]
    (target,) = distill.targets(_rows(old, teacher, mask, [0.0, 0.0]), lambda x: x)
    assert target.advantages.tolist() == [[1.0, -1.0], [-2.0, 0.0]]
    # GRPO's group advantage (+-0.7071 for scores 1 and 0, std unbiased) plus 0.5 times the term
    grpo = instantiate(compose_config(["algo=grpo", "algo.distill_coef=0.5", "teacher=tiny"]).algo)
    values, _ = grpo.sample_values(t([1.0, 0.0]), ids([0, 0]), ids([2, 2]), 4)
    (target,) = grpo.targets(_rows(old, teacher, mask, values.tolist()), lambda x: x)
    a = 0.70710677  # (1 - 0.5) / std([1, 0]) = 0.5 / 0.7071
    assert target.advantages.flatten().tolist() == pytest.approx(
        [a + 0.5, a - 0.5, -a - 1.0, 0.0], abs=1e-5
    )  # (eps 1e-6 in the std)


def test_the_teacher_term_without_the_old_logprobs_is_refused():
    from tests.conftest import compose_config
    from hydra.utils import instantiate

    distill = instantiate(compose_config(["algo=on_policy_distill", "teacher=tiny"]).algo)
    rows = _rows([[-1.0]], [[-1.0]], [[1]], [0.0])
    rows[0].old_logprobs = None
    with pytest.raises(ValueError, match="teacher term reads the old"):
        distill.targets(rows, lambda x: x)
