"""Packed forward (one [1, N] row, attention cut at cu_seqlens) == padded forward, on CPU.

Tolerance: float32 on CPU, atol 1e-4 on logprobs and values. The two layouts run different
kernels (one SDPA call per sequence vs one masked call over padded rows), so results agree to
float32 rounding, not bitwise.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_orch.trainer.forward import load_critic, load_policy, sequence_logprobs, sequence_values
from rlhf_orch.transfer.batch import PackedBatch, Sample
from rlhf_orch.transfer.micro_batches import plan_token_budget_micro_batches

ATOL = 1e-4
PAD = 0


@pytest.fixture(scope="module")
def models(tiny_model_path):
    torch.manual_seed(0)
    policy = load_policy(tiny_model_path, "float32").eval()
    critic = load_critic(tiny_model_path, "float32").eval()
    with torch.no_grad():  # a non-zero value head, so values are not trivially equal
        critic.value_head.weight.normal_(0, 0.1)
        critic.value_head.bias.fill_(0.3)
    return policy, critic


def _samples(lengths: list[tuple[int, int]], vocab: int = 40, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Sample(
            prompt_ids=torch.randint(3, vocab, (p,), generator=gen),
            response_ids=torch.randint(3, vocab, (r,), generator=gen),
            reward=float(i),
            index=i,
        )
        for i, (p, r) in enumerate(lengths)
    ]


def _compare(models, samples):
    policy, critic = models
    packed = PackedBatch.from_samples(samples)
    padded = packed.to_padded(PAD)
    with torch.no_grad():
        padded.fields["lp"] = sequence_logprobs(policy, padded, 1.0)
        padded.fields["v"] = sequence_values(critic, padded)
        lp_packed = sequence_logprobs(policy, packed, 1.0)
        v_packed = sequence_values(critic, packed)
    # The padded results moved into the packed layout (exact conversion, 0 where nothing is predicted).
    expected = padded.to_packed().fields
    assert lp_packed.shape == v_packed.shape == packed.input_ids.shape
    torch.testing.assert_close(lp_packed, expected["lp"], atol=ATOL, rtol=0)
    torch.testing.assert_close(v_packed, expected["v"], atol=ATOL, rtol=0)
    return packed, lp_packed


def test_packed_equals_padded_mixed_lengths(models):
    packed, lp = _compare(models, _samples([(5, 7), (3, 1), (9, 20), (2, 0), (4, 11)]))
    assert (lp[packed.action_mask] < 0).all()  # real log-probabilities at every action


def test_sequences_of_length_one(models):
    # A 1-token sequence (prompt only, empty response) predicts nothing; neighbours are unaffected.
    _compare(models, _samples([(1, 0), (6, 3), (1, 0), (1, 0), (2, 5)]))
    packed, lp = _compare(models, _samples([(1, 0)]))
    assert lp.tolist() == [0.0]


def test_micro_batch_holding_exactly_the_budget(models):
    lengths = [(4, 6), (3, 5), (2, 4), (5, 3), (6, 6)]  # 10 + 8 + 6 + 8 + 12 = 44 tokens
    budget = 22
    samples = _samples(lengths)
    plan = plan_token_budget_micro_batches([p + r for p, r in lengths], budget, num_ranks=1)
    mbs = [PackedBatch.from_samples(samples).select(mb) for mb in plan[0]]
    assert any(mb.num_tokens == budget for mb in mbs)
    for mb in mbs:
        assert mb.num_tokens <= budget
        _compare(models, mb.to_samples())


def test_attention_does_not_cross_sequence_boundaries(models):
    policy, _ = models
    a, b = _samples([(4, 6)], seed=1), _samples([(5, 5)], seed=2)
    alone = PackedBatch.from_samples(b)
    b[0].index = 1
    together = PackedBatch.from_samples(a + b)
    with torch.no_grad():
        lp_alone = sequence_logprobs(policy, alone, 1.0)
        lp_together = sequence_logprobs(policy, together, 1.0)
    torch.testing.assert_close(lp_together[10:], lp_alone, atol=ATOL, rtol=0)


def test_gradients_match(models, tiny_model_path):
    policy = load_policy(tiny_model_path, "float32").train()
    samples = _samples([(3, 4), (6, 9), (2, 1)])
    packed = PackedBatch.from_samples(samples)
    padded = packed.to_padded(PAD)
    grads = []
    for mb in (padded, packed):
        policy.zero_grad()
        lp = sequence_logprobs(policy, mb, 1.0)
        (lp * mb.action_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)


def test_only_positions_that_predict_a_model_token_reach_the_lm_head(models):
    """The LM head (and the vocabulary reductions after it) runs on the action positions alone in
    the packed layout, and on the columns from the first action on in the padded one -- a prompt's
    positions cost the head's V x hidden products for outputs every consumer masks away."""
    policy, _ = models
    packed = PackedBatch.from_samples(_samples([(9, 3), (12, 2), (7, 4)]))
    padded = packed.to_padded(PAD)
    rows: list[int] = []
    handle = policy.lm_head.register_forward_hook(
        lambda mod, args, out: rows.append(args[0].shape[0] * args[0].shape[1])
    )
    try:
        with torch.no_grad():
            sequence_logprobs(policy, packed, 1.0)
            sequence_logprobs(policy, padded, 1.0)
    finally:
        handle.remove()
    assert rows[0] == int(packed.action_mask.sum()) == 9
    assert rows[1] == 3 * (padded.input_ids.shape[1] - 1 - 6)  # columns 6.. (the shortest prompt's last position on)
