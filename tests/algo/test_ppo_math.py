"""Token-level RL math against hand-computed numbers (the arithmetic is written out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_orch.algo.advantages import gae_advantages
from rlhf_orch.algo.losses import aggregate_loss, clipped_policy_loss, clipped_value_loss, kl_divergence
from rlhf_orch.algo.ppo_math import logprobs_from_logits, masked_mean, masked_whiten, token_rewards


def policy_loss(logp, old, adv, mask, clip_eps):
    """PPO's symmetric clip, token mean (the shape of CleanRL's loss)."""
    loss_mat, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps, clip_eps)
    return aggregate_loss(loss_mat, mask, "token-mean"), stats


def value_loss(values, old, returns, mask, clip_eps):
    loss_mat, stats = clipped_value_loss(values, old, returns, mask, clip_eps)
    return aggregate_loss(loss_mat, mask, "token-mean"), stats


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected) if not torch.is_tensor(expected) else expected, atol=atol, rtol=0)


# --------------------------------------------------------------------------- KL estimators
def test_kl_k1_and_k3_by_hand():
    # token 0: p=0.5, p_ref=0.25   k1 = ln 0.5 - ln 0.25 = ln 2 = 0.693147
    #                              k3: d = ref - logp = -ln 2; e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # token 1: logp = ref          k1 = k3 = 0
    # token 2: logp=-1, ref=-0.5   k1 = -0.5 (k1 can be negative)
    #                              k3: d = 0.5; e^0.5 - 0.5 - 1 = 1.648721 - 1.5 = 0.148721 (k3 >= 0)
    logp = t([[math.log(0.5), -2.0, -1.0]])
    ref = t([[math.log(0.25), -2.0, -0.5]])
    close(kl_divergence(logp, ref, "k1"), [[0.693147, 0.0, -0.5]])
    close(kl_divergence(logp, ref, "k3"), [[0.193147, 0.0, 0.148721]])


def test_unknown_kl_estimator_names_value_and_choices():
    with pytest.raises(ValueError) as err:
        kl_divergence(t([0.0]), t([0.0]), "k5")
    message = str(err.value)
    assert "'k5'" in message
    assert "k1" in message and "low_var_kl" in message


# --------------------------------------------------------------------------- token rewards
def test_token_rewards_kl_everywhere_score_at_last_real_token():
    # kl_coef = 0.1
    # row 0 (3 real):  [-0.01, -0.02, -0.03 + 1.0] = [-0.01, -0.02, 0.97]
    # row 1 (2 real):  [-0.05, -0.04 - 1.0, pad]   = [-0.05, -1.04, 0]   (pad kl 9.9 ignored)
    scores = t([1.0, -1.0])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.4, 9.9]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    close(token_rewards(scores, kl, mask, kl_coef=0.1), [[-0.01, -0.02, 0.97], [-0.05, -1.04, 0.0]])


def test_token_rewards_leading_prompt_positions_and_empty_row():
    # [B, L-1] layout: the first position is a prompt position (mask 0); garbage there is ignored.
    # row 0: positions 1,2 real -> [0, -0.2, -0.3 + 2] = [0, -0.2, 1.7]
    # row 1: no real token (empty response) -> no action to credit: all zeros, score dropped.
    scores = t([2.0, 5.0])
    kl = t([[float("nan"), 2.0, 3.0], [1.0, 1.0, 1.0]])
    mask = t([[0, 1, 1], [0, 0, 0]])
    close(token_rewards(scores, kl, mask, kl_coef=0.1), [[0.0, -0.2, 1.7], [0.0, 0.0, 0.0]])


def test_token_rewards_keep_placed_rewards_and_put_the_rest_of_the_score_last():
    # env.reward=per_turn: row 0 has turn rewards 0.3 (position 0) and 0.5 (position 2) of a score
    # of 1.0 -> [0.3, 0, 0.5 + (1.0 - 0.8)] = [0.3, 0, 0.7]; row 1's placed 0.4 sits on a masked
    # position (an observation): not placed, so the whole score goes last -> [0, -1.0, 0]
    scores = t([1.0, -1.0])
    kl = torch.zeros(2, 3)
    mask = t([[1, 1, 1], [1, 1, 0]])
    placed = t([[0.3, 0.0, 0.5], [0.0, 0.0, 0.4]])
    out = token_rewards(scores, kl, mask, kl_coef=0.1, placed=placed)
    close(out, [[0.3, 0.0, 0.7], [0.0, -1.0, 0.0]])
    close(out.sum(-1), scores)  # a row's rewards still sum to its score


# --------------------------------------------------------------------------- GAE
def test_gae_gamma1_lam1_is_reward_to_go_minus_value():
    # r = [0.1, -0.2, 1.0]  reward-to-go = [0.9, 0.8, 1.0]
    # V = [0.3,  0.4, 0.5]  A = rtg - V  = [0.6, 0.4, 0.5];  returns = rtg
    rewards = t([[0.1, -0.2, 1.0]])
    values = t([[0.3, 0.4, 0.5]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.6, 0.4, 0.5]])
    close(ret, [[0.9, 0.8, 1.0]])


def test_gae_three_tokens_gamma09_lam08_written_out():
    # gamma = 0.9, lam = 0.8, gamma*lam = 0.72; r = [0, 0, 1], V = [0.5, 0.6, 0.7]; V after end = 0
    # t=2: delta = 1 + 0.9*0   - 0.7 = 0.3     A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03    A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04    A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_padding_and_prompt_positions_do_not_leak():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    expected_adv, expected_ret = gae_advantages(rewards, values, torch.ones(1, 3), 0.9, 0.8)
    # Same row with a leading prompt position and two right pads full of garbage.
    nan = float("nan")
    padded_rewards = t([[123.0, 0.0, 0.0, 1.0, 50.0, nan]])
    padded_values = t([[-7.0, 0.5, 0.6, 0.7, 9.0, nan]])
    mask = t([[0, 1, 1, 1, 0, 0]])
    adv, ret = gae_advantages(padded_rewards, padded_values, mask, 0.9, 0.8)
    close(adv[:, 1:4], expected_adv)
    close(ret[:, 1:4], expected_ret)
    close(adv[:, [0, 4, 5]], [[0.0, 0.0, 0.0]])
    close(ret[:, [0, 4, 5]], [[0.0, 0.0, 0.0]])


def test_gae_rows_of_different_lengths_are_independent():
    # Row 1 is one real token: A = r - V = 2 - 0.5 = 1.5 (next value is 0, the episode ended).
    rewards = t([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    values = t([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.8)
    close(adv, [[0.21712, 0.246, 0.3], [1.5, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [2.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- masked reductions
def test_masked_mean_ignores_padding_and_handles_empty():
    x = t([[1.0, 2.0, float("nan")], [3.0, float("inf"), 4.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    close(masked_mean(x, mask, dim=1), [1.5, 3.0])
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)  # no real token: 0, not NaN


def test_masked_whiten_by_hand():
    # x = [1,2,3,4]: mean 2.5, unbiased var = (2.25+0.25+0.25+2.25)/3 = 5/3, std = 1.290994
    # whitened = (x - 2.5)/1.290994 = [-1.161895, -0.387298, 0.387298, 1.161895]
    x = t([[1.0, 2.0, 99.0], [3.0, 4.0, -99.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    close(masked_whiten(x, mask), [[-1.161895, -0.387298, 0.0], [0.387298, 1.161895, 0.0]])
    # shift_mean=False adds the mean back: + 2.5
    close(
        masked_whiten(x, mask, shift_mean=False),
        [[1.338105, 2.112702, 0.0], [2.887298, 3.661895, 0.0]],
    )


# --------------------------------------------------------------------------- policy loss
def test_policy_loss_clipping_cases_by_hand():
    # eps = 0.2; logp_old = 0, logp = ln(ratio); per-token max(-A*r, -A*clip(r, 0.8, 1.2)):
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  clipped   (no incentive to push r further up)
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5  unclipped (still penalised for the bad action)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5  unclipped
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  clipped
    # loss = (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.15; clipfrac = 2/4
    # approx_kl = mean((r-1) - ln r): 0.5 - ln1.5 = 0.094535; -0.5 - ln0.5 = 0.193147
    #           = (2*0.094535 + 2*0.193147)/4 = 0.143841
    ratios = [1.5, 1.5, 0.5, 0.5]
    logp = torch.log(t([ratios])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = t([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    close(loss, 0.15)
    close(stats["clipfrac"], 0.5)
    close(stats["approx_kl"], 0.143841)
    # d loss / d logp = -A * r / 4 for unclipped tokens, 0 for clipped ones:
    #   [0, 1.5/4, -0.5/4, 0] = [0, 0.375, -0.125, 0]
    loss.backward()
    close(logp.grad, [[0.0, 0.375, -0.125, 0.0]])


def test_policy_loss_inside_trust_region_is_plain_surrogate():
    # r = 1.1 (inside [0.8, 1.2]), A = 2: loss = -2 * 1.1 = -2.2, nothing clipped.
    logp = torch.log(t([[1.1]]))
    loss, stats = policy_loss(logp, torch.zeros(1, 1), t([[2.0]]), torch.ones(1, 1), 0.2)
    close(loss, -2.2)
    close(stats["clipfrac"], 0.0)


def test_policy_loss_padding_does_not_change_results_or_gradients():
    logp = torch.log(t([[1.5, 0.5]])).requires_grad_()
    loss, stats = policy_loss(logp, torch.zeros(1, 2), t([[1.0, 1.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    # Same tokens plus a pad with -inf log-probs and a NaN advantage.
    logp_padded = torch.cat([torch.log(t([[1.5, 0.5]])), t([[float("-inf")]])], 1).requires_grad_()
    old_padded = t([[0.0, 0.0, float("-inf")]])
    adv_padded = t([[1.0, 1.0, float("nan")]])
    loss_p, stats_p = policy_loss(logp_padded, old_padded, adv_padded, t([[1, 1, 0]]), 0.2)
    loss_p.backward()
    close(loss_p, loss)
    close(stats_p["clipfrac"], stats["clipfrac"])
    close(stats_p["approx_kl"], stats["approx_kl"])
    close(logp_padded.grad, torch.cat([logp.grad, torch.zeros(1, 1)], 1))


# --------------------------------------------------------------------------- value loss
def test_value_loss_clipping_by_hand():
    # eps = 0.2, V_old = 0 -> V_clip = clip(V, -0.2, 0.2)
    #   V=0.5, R=1: (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64 -> 0.64 clipped
    #   V=0.5, R=0: 0.25,             (0.2-0)^2 = 0.04 -> 0.25
    #   V=0.1, R=1: 0.81,             V_clip = 0.1     -> 0.81 (equal, not counted as clipped)
    # loss = 0.5 * (0.64 + 0.25 + 0.81) / 3 = 0.283333; vf_clipfrac = 1/3
    values = t([[0.5, 0.5, 0.1, 42.0]]).requires_grad_()
    returns = t([[1.0, 0.0, 1.0, float("nan")]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = value_loss(values, torch.zeros(1, 4), returns, mask, clip_eps=0.2)
    close(loss, 0.283333)
    close(stats["vf_clipfrac"], 1.0 / 3.0)
    # Gradient: clipped token 0 -> 0; token 1: 0.5*2*(0.5-0)/3 = 0.166667;
    #           token 2: 0.5*2*(0.1-1)/3 = -0.3; pad -> 0
    loss.backward()
    close(values.grad, [[0.0, 0.166667, -0.3, 0.0]])


# --------------------------------------------------------------------------- log-probs
def test_logprobs_from_logits_by_hand():
    # logits [0, ln 3] -> softmax [0.25, 0.75]; token 1 -> ln 0.75 = -0.287682, token 0 -> ln 0.25
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    tokens = torch.tensor([[1, 0]])
    close(logprobs_from_logits(logits, tokens), [[math.log(0.75), math.log(0.25)]])
    # temperature 2: logits/2 = [0, ln sqrt3] -> softmax [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    s3 = math.sqrt(3.0)
    close(
        logprobs_from_logits(logits, tokens, temperature=2.0),
        [[math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))]],
    )


def test_logprobs_from_logits_chunked_matches_log_softmax_with_grad():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    reference = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (grad_ref,) = torch.autograd.grad(reference.sum(), logits)
    # 23 elements per chunk -> 2 rows per chunk, 8 chunks (last one partial)
    chunked = logprobs_from_logits(logits, tokens, max_chunk_elements=23)
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    close(chunked, reference, atol=1e-5)
    close(grad_chunked, grad_ref, atol=1e-5)
    # Packed layout ([N, V], [N]) gives the same numbers.
    close(logprobs_from_logits(logits.reshape(15, 11), tokens.reshape(15)), reference.reshape(15), atol=1e-5)


def test_logprobs_from_logits_bf16_is_computed_in_float32():
    logits = torch.randn(2, 4, 7).to(torch.bfloat16)
    tokens = torch.randint(0, 7, (2, 4))
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    reference = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    close(out, reference, atol=1e-6)


def test_logprobs_from_logits_shape_mismatch():
    with pytest.raises(ValueError, match="tokens"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
