"""Experience formats (Sample -> PaddedBatch <-> PackedBatch) and micro-batch planners."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, PackedBatch, PaddedBatch, Sample
from rlhf_orch.transfer.micro_batches import plan_token_budget_micro_batches, shard_for_ranks, split_by_count

PAD = 0


def hand_samples() -> list[Sample]:
    return [
        # A: 2 prompt + 3 response tokens
        Sample([5, 6], [7, 8, 9], 1.0, [-0.1, -0.2, -0.3], weight_version=3, index=0),
        # B: 1 prompt + a length-1 response
        Sample([5], [7], 0.5, [-0.4], weight_version=3, index=1),
        # C: an empty response -- kept, with no action position
        Sample([1, 2, 3], [], -1.0, [], weight_version=2, index=2),
    ]


def random_samples(n: int, seed: int, with_logprobs: bool = True) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        response = [rng.randint(1, 50) for _ in range(rng.choice([0, 1, 1, 2, 5, 9]))]
        logprobs = [-rng.random() for _ in response] if with_logprobs else None
        samples.append(Sample(prompt, response, rng.uniform(-1, 1), logprobs, rng.randint(0, 4), i))
    rng.shuffle(samples)  # rollout order != index order: indices must carry it
    return samples


def as_lists(sample: Sample) -> tuple:
    """Comparable form; floats rounded because batches store them as float32."""
    logprobs = sample.engine_logprobs
    return (
        torch.as_tensor(sample.prompt_ids).tolist(),
        torch.as_tensor(sample.response_ids).tolist(),
        round(float(sample.reward), 5),
        None if logprobs is None else [round(float(x), 5) for x in logprobs],
        sample.weight_version,
        sample.index,
    )


def assert_batches_equal(a, b) -> None:
    assert type(a) is type(b)
    for name in ("input_ids", "position_ids", "action_mask", "scores", "indices", "weight_versions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("attention_mask", "cu_seqlens"):
        if hasattr(a, name):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.fields.keys() == b.fields.keys()
    for name in a.fields:
        assert torch.equal(a.fields[name], b.fields[name]), name


# --------------------------------------------------------------------------- layouts by hand
def test_padded_layout_by_hand():
    batch = PaddedBatch.from_samples(hand_samples(), pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0], [1, 2, 3, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0], [0, 1, 2, 0, 0]]
    # action t <=> token t+1 is a response token: A's response tokens sit at 2..4 -> actions 1..3
    assert batch.action_mask.int().tolist() == [[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(
        batch.fields[ENGINE_LOGPROBS],
        torch.tensor([[0, -0.1, -0.2, -0.3], [-0.4, 0, 0, 0], [0, 0, 0, 0]]),
    )
    assert batch.scores.tolist() == [1.0, 0.5, -1.0]
    assert batch.indices.tolist() == [0, 1, 2]
    assert batch.weight_versions.tolist() == [3, 3, 2]
    assert batch.num_tokens == 10 and len(batch) == 3
    assert batch.response_lens.tolist() == [3, 1, 0]


def test_packed_layout_by_hand():
    batch = PackedBatch.from_samples(hand_samples())
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 5, 7, 1, 2, 3]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 5, 7, 10]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]
    # 1 where the NEXT token of the same sequence is a response token; 0 at each last token
    assert batch.action_mask.int().tolist() == [0, 1, 1, 1, 0, 1, 0, 0, 0, 0]
    torch.testing.assert_close(
        batch.fields[ENGINE_LOGPROBS],
        torch.tensor([0, -0.1, -0.2, -0.3, 0, -0.4, 0, 0, 0, 0]),
    )
    assert batch.num_tokens == 10 and batch.max_seqlen == 5 and len(batch) == 3
    assert batch.response_lens.tolist() == [3, 1, 0]


def test_pad_to_and_too_short_pad_to():
    batch = PaddedBatch.from_samples(hand_samples(), pad_id=PAD, pad_to=8)
    assert batch.input_ids.shape == (3, 8) and batch.action_mask.shape == (3, 7)
    assert batch.num_tokens == 10
    assert_batches_equal(batch.to_packed(), PackedBatch.from_samples(hand_samples()))
    with pytest.raises(ValueError, match="pad_to=4"):
        PaddedBatch.from_samples(hand_samples(), pad_id=PAD, pad_to=4)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_every_field_of_every_sample(seed):
    samples = random_samples(13, seed)
    padded = PaddedBatch.from_samples(samples, pad_id=PAD)
    # Trainer-side per-token fields, given per sample over the real response positions.
    rng = torch.Generator().manual_seed(seed)
    trainer_fields = {
        name: [torch.randn(len(s.response_ids), generator=rng) for s in samples]
        for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")
    }
    for name, per_sample in trainer_fields.items():
        padded.add_response_field(name, per_sample)

    packed = padded.to_packed()
    padded_again = packed.to_padded(pad_id=PAD)
    assert_batches_equal(padded_again, padded)
    assert_batches_equal(padded_again.to_packed(), packed)

    for batch in (padded, packed, padded_again):
        # Same samples, same order, nothing lost or duplicated.
        assert [as_lists(s) for s in batch.to_samples()] == [as_lists(s) for s in samples]
        per_sample = batch.to_samples_fields()
        assert len(per_sample) == len(samples)
        for b, sample in enumerate(samples):
            assert per_sample[b].keys() == {ENGINE_LOGPROBS, *trainer_fields}
            for name, values in trainer_fields.items():
                assert torch.equal(per_sample[b][name], values[b][: len(sample.response_ids)])
    assert sorted(packed.indices.tolist()) == list(range(13))


def test_round_trip_from_packed_side_and_without_engine_logprobs():
    samples = random_samples(9, seed=5, with_logprobs=False)
    packed = PackedBatch.from_samples(samples)
    assert packed.fields == {}
    assert_batches_equal(packed.to_padded(PAD).to_packed(), packed)
    assert_batches_equal(packed.to_padded(PAD, pad_to=40).to_packed(), packed)
    assert [as_lists(s) for s in packed.to_samples()] == [as_lists(s) for s in samples]


def test_tensor_ids_are_accepted():
    samples = [Sample(torch.tensor([3, 4]), torch.tensor([5]), 1.0, torch.tensor([-0.5]), 0, 7)]
    batch = PackedBatch.from_samples(samples)
    assert batch.input_ids.tolist() == [3, 4, 5] and batch.indices.tolist() == [7]


# --------------------------------------------------------------------------- edge cases
def test_length_one_response_has_exactly_one_action_at_the_last_prompt_token():
    batch = PaddedBatch.from_samples([Sample([1, 2, 3], [9], 0.0)], pad_id=PAD)
    assert batch.action_mask.int().tolist() == [[0, 0, 1]]


def test_empty_response_is_kept_with_zero_action_mask():
    batch = PaddedBatch.from_samples([Sample([4], [], 2.0, index=5)], pad_id=PAD)
    # A 1-token sequence has no next-token position at all.
    assert batch.input_ids.tolist() == [[4]] and batch.action_mask.shape == (1, 0)
    assert batch.scores.tolist() == [2.0] and batch.indices.tolist() == [5]
    packed = batch.to_packed()
    assert packed.action_mask.tolist() == [False]
    assert [as_lists(s) for s in packed.to_samples()] == [([4], [], 2.0, None, 0, 5)]


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="index=4 has an empty prompt"):
        PackedBatch.from_samples([Sample([], [1, 2], 1.0, index=4)])


def test_engine_logprobs_on_some_samples_only_is_refused():
    samples = [Sample([1], [2], 0.0, [-0.1]), Sample([1], [2], 0.0, None)]
    with pytest.raises(ValueError, match="1 of 2 samples carry engine_logprobs"):
        PackedBatch.from_samples(samples)


def test_engine_logprobs_of_wrong_length_is_refused():
    with pytest.raises(ValueError, match="do not match response lengths"):
        PackedBatch.from_samples([Sample([1], [2, 3], 0.0, [-0.1])])


def test_zero_samples_is_refused():
    with pytest.raises(ValueError, match="zero samples"):
        PackedBatch.from_samples([])


def test_to_packed_refuses_left_padding():
    batch = PaddedBatch.from_samples(hand_samples(), pad_id=PAD)
    batch.attention_mask = batch.attention_mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        batch.to_packed()


# --------------------------------------------------------------------------- slicing and sizes
def test_packed_split_is_a_view_and_covers_everything():
    samples = random_samples(10, seed=3)
    packed = PackedBatch.from_samples(samples)
    parts = packed.split(split_by_count(len(packed), 4))
    assert [len(p) for p in parts] == [4, 4, 2]
    assert parts[1].input_ids.data_ptr() == packed.input_ids[int(packed.cu_seqlens[4]) :].data_ptr()
    assert parts[1].cu_seqlens[0] == 0 and parts[1].position_ids[0] == 0
    rebuilt = [s for p in parts for s in p.to_samples()]
    assert [as_lists(s) for s in rebuilt] == [as_lists(s) for s in samples]
    # Batches pickle their tensors as numpy buffers (the wire format): a view ships only its
    # own bytes, exactly like a clone -- never its parent's whole storage.
    assert len(pickle.dumps(parts[2])) == len(pickle.dumps(parts[2].clone()))
    assert len(pickle.dumps(parts[2])) < len(pickle.dumps(packed))
    with pytest.raises(ValueError, match="contiguous ranges"):
        packed.split([range(0, 10, 2)])


def test_select_gathers_sequences_in_given_order():
    samples = random_samples(6, seed=4)
    packed = PackedBatch.from_samples(samples)
    padded = packed.to_padded(PAD)
    order = [4, 0, 5]
    expected = [as_lists(samples[i]) for i in order]
    assert [as_lists(s) for s in packed.select(order).to_samples()] == expected
    assert [as_lists(s) for s in padded.select(order).to_samples()] == expected
    assert [as_lists(s) for s in padded.split([range(2, 4)])[0].to_samples()] == [
        as_lists(samples[2]),
        as_lists(samples[3]),
    ]


def test_nbytes_counts_every_tensor():
    packed = PackedBatch.from_samples(hand_samples())
    # input_ids 10*8 + cu 4*4 + position 10*8 + action 10*1 + scores 3*4 + indices 3*8
    # + weight_versions 3*8 + engine_logprobs 10*4 = 80+16+80+10+12+24+24+40
    assert packed.nbytes == 286
    padded = packed.to_padded(PAD)
    # ids, attention, position 3*5*8 each; action 3*4*1; scores 12; indices 24; versions 24;
    # engine_logprobs 3*4*4
    assert padded.nbytes == 3 * 120 + 12 + 12 + 24 + 24 + 48


# --------------------------------------------------------------------------- planners
def test_split_by_count():
    assert split_by_count(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert split_by_count(8, 4) == [range(0, 4), range(4, 8)]
    assert split_by_count(0, 4) == []
    with pytest.raises(ValueError, match="algo.micro_batch_size"):
        split_by_count(8, 0)


def test_shard_for_ranks():
    assert shard_for_ranks(8, 2) == [range(0, 4), range(4, 8)]
    assert shard_for_ranks(3, 1) == [range(0, 3)]
    with pytest.raises(ValueError) as err:
        shard_for_ranks(10, 4)
    for key in ("algo.rollout_batch_size", "algo.samples_per_prompt", "data-parallel"):
        assert key in str(err.value)


def check_plan(plan, lengths, budget, num_ranks):
    assert len(plan) == num_ranks
    assert len({len(rank) for rank in plan}) == 1, "every rank needs the same micro-batch count"
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(len(lengths))), "every index exactly once"
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    # Greedy LPT bound: the most and least loaded ranks differ by at most the longest sequence.
    assert max(loads) - min(loads) <= max(lengths, default=0)


def test_token_budget_plan_by_hand_with_split_to_equalise():
    # LPT, longest first: seq3(5)->r0, seq0(4)->r1, seq4(4)->r1 (4<5), seq2(3)->r0 (5<8),
    # seq1(1)->r0 (tie 8/8, tie 2/2 sequences, lower rank). r0 = {3,2,1} 9 tokens, r1 = {0,4} 8.
    # FFD, budget 8: r0 -> [2,3] (exactly 8) + [1]; r1 -> [0,4] (exactly 8): one micro-batch.
    # r1 has one fewer, so its two-sequence micro-batch is split in two: [0], [4].
    lengths = [4, 1, 3, 5, 4]
    plan = plan_token_budget_micro_batches(lengths, token_budget=8, num_ranks=2)
    assert plan == [[[2, 3], [1]], [[0], [4]]]
    check_plan(plan, lengths, 8, 2)


def test_token_budget_exactly_at_budget_is_one_micro_batch():
    plan = plan_token_budget_micro_batches([3, 3, 4], token_budget=10, num_ranks=1)
    assert plan == [[[0, 1, 2]]]


def test_token_budget_explicit_empty_micro_batch_when_a_rank_runs_out_of_sequences():
    # 3 sequences of 10 on 2 ranks with budget 10: r0 gets two micro-batches, r1 only has one
    # sequence, so it gets an explicit empty micro-batch to keep the backward count equal.
    plan = plan_token_budget_micro_batches([10, 10, 10], token_budget=10, num_ranks=2)
    assert plan == [[[0], [2]], [[1], []]]


def test_token_budget_more_ranks_than_sequences():
    plan = plan_token_budget_micro_batches([5], token_budget=8, num_ranks=3)
    assert plan == [[[0]], [[]], [[]]]
    assert plan_token_budget_micro_batches([], token_budget=8, num_ranks=2) == [[], []]


@pytest.mark.parametrize("seed", range(30))
def test_token_budget_plan_properties_random(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(0, 40))]
    budget = max(lengths, default=1) + rng.choice([0, 0, 10, 100])
    num_ranks = rng.randint(1, 4)
    check_plan(plan_token_budget_micro_batches(lengths, budget, num_ranks), lengths, budget, num_ranks)


def test_token_budget_balances_tokens_across_ranks():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
    plan = plan_token_budget_micro_batches(lengths, token_budget=200, num_ranks=2)
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert loads == [280, 270]  # LPT: total 550, best possible split 280/270


def test_token_budget_over_long_sequence_names_the_key_and_fix():
    with pytest.raises(ValueError) as err:
        plan_token_budget_micro_batches([5, 12, 7], token_budget=10, num_ranks=2)
    message = str(err.value)
    assert "transfer.token_budget=10" in message and "sequence 1 with 12 tokens" in message
    assert "transfer.token_budget >= 12" in message


def test_token_budget_zero_means_derive_first():
    with pytest.raises(ValueError, match="transfer.token_budget=0"):
        plan_token_budget_micro_batches([1, 2], token_budget=0, num_ranks=1)
