"""Engines pack each sequence as it finishes (`PackedBuffer`); trainers use pieces as they are.

In-process (no Ray): an engine's pieces must equal `PackedBatch.from_samples` of the same samples
in the same order, whatever the rounds, replacements, growth and member order; a held rollout
exported as `Sample`s and imported into another engine must give identical pieces; the engine-aware
planner must keep its guarantees; a micro-batch within one piece is a view that still takes fields.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_orch.transfer.base import RolloutRequest
from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, PackedBatch, Sample
from rlhf_orch.transfer.micro_batches import plan_token_budget_micro_batches
from rlhf_orch.transfer.packed_buffer import PackedBuffer
from rlhf_orch.transfer.inbox import assemble_packed
from rlhf_orch.transfer.packed import PackedTransfer, _engine_ordered
from rlhf_orch.transfer.plan import pieces_per_engine, plan_packed, prompt_chunks, whole_prompt_requests
from rlhf_orch.transfer.synthetic import LengthModel, SyntheticEngine, synthetic_prompts, zero_reward

PROMPTS, SPP = 10, 4
TENSORS = ("input_ids", "cu_seqlens", "position_ids", "action_mask", "scores", "indices", "weight_versions")


def _engine(seed: int = 7) -> SyntheticEngine:
    return SyntheticEngine(LengthModel(mean=25, max_len=70), vocab_size=100, seed=seed)


def _job(prompts: range, prompt_ids):
    request = RolloutRequest(
        prompts=[None] * PROMPTS,
        prompt_ids=prompt_ids,
        samples_per_prompt=SPP,
        max_tokens=70,
        temperature=1.0,
        scorer=zero_reward,
        num_shards=2,
        micro_batch_size=4,
        pad_id=0,
        max_seq_len=40 + 70,
        decode=lambda ids: [""] * len(ids),
    )
    return request.job(prompts, zero_reward)


def _reference(prompt_ids, seed: int = 7) -> dict[int, Sample]:
    samples, _ = _engine(seed).produce_samples(
        whole_prompt_requests(range(PROMPTS), SPP), _job(range(PROMPTS), prompt_ids)
    )
    for s in samples:
        s.reward = 0.0  # what zero_reward scores
    return {s.index: s for s in samples}


def assert_same_batch(got: PackedBatch | None, want: PackedBatch | None) -> None:
    assert (got is None) == (want is None)
    if got is None:
        return
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert sorted(got.fields) == sorted(want.fields)
    for name in want.fields:
        assert torch.equal(got.fields[name], want.fields[name]), name


def _members(indices: list[int], seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    shuffled = rng.sample(indices, len(indices))
    # three ranks, a few micro-batches each, one rank with nothing from this engine
    return [[shuffled[0:3], shuffled[3:9]], [[], shuffled[9:]], [[]]]


def test_pieces_equal_packing_the_samples_in_cut_order():
    prompt_ids = synthetic_prompts(PROMPTS, 40, vocab_size=100)
    want = _reference(prompt_ids)
    engine = _engine()
    # Two rounds before one cut (dynamic sampling), and an index generated again replaces the first.
    meta1 = engine.produce_and_hold(whole_prompt_requests(range(0, 6), SPP), _job(range(0, 6), prompt_ids))
    engine.produce_and_hold(whole_prompt_requests(range(5, PROMPTS), SPP), _job(range(5, PROMPTS), prompt_ids))
    assert meta1.indices == list(range(6 * SPP))
    assert meta1.seq_lens == [len(want[i].prompt_ids) + len(want[i].response_ids) for i in meta1.indices]
    assert [s.index for s in engine.held_samples()] == list(range(PROMPTS * SPP))
    members = _members(list(range(PROMPTS * SPP)), seed=1)
    pieces = engine.cut_for_ranks(members)
    for rank, piece in zip(members, pieces):
        flat = [want[i] for mb in rank for i in mb]
        assert_same_batch(piece, PackedBatch.from_samples(flat) if flat else None)
    assert engine.held_samples() == []  # a cut releases everything


def test_exported_then_imported_engine_yields_identical_pieces():
    prompt_ids = synthetic_prompts(PROMPTS, 40, vocab_size=100)
    source = _engine()
    source.weight_version = 3
    source.produce_and_hold(whole_prompt_requests(range(PROMPTS), SPP), _job(range(PROMPTS), prompt_ids))
    exported = source.held_samples()
    assert all(isinstance(s, Sample) and s.weight_version == 3 for s in exported)
    assert all(len(s.engine_logprobs) == len(s.response_ids) for s in exported)
    assert all(sorted(s.fields) == sorted(source.fields) for s in exported)

    restored = _engine(seed=99)  # another engine (e.g. after a resume): its own seed does not matter
    restored.hold_samples(exported)
    assert [s.index for s in restored.held_samples()] == [s.index for s in exported]
    for got, want in zip(restored.held_samples(), exported):
        assert torch.equal(torch.as_tensor(got.prompt_ids), torch.as_tensor(want.prompt_ids))
        assert torch.equal(torch.as_tensor(got.response_ids), torch.as_tensor(want.response_ids))
        assert (got.reward, got.weight_version, got.truncated) == (want.reward, want.weight_version, want.truncated)

    members = _members([s.index for s in exported], seed=2)
    for a, b in zip(source.cut_for_ranks(members), restored.cut_for_ranks(members)):
        assert_same_batch(b, a)


def test_buffer_grows_keeps_capacity_and_handles_empty_responses():
    rng = random.Random(0)
    buffer = PackedBuffer(tokens=1, rows=1)  # forces geometric growth many times
    samples = []
    for step in range(2):
        samples = []
        for i in range(200):
            p, r = rng.randint(1, 30), rng.choice([0, 1, 5, 60, 300])
            samples.append(
                Sample(
                    prompt_ids=[rng.randint(1, 50) for _ in range(p)],
                    response_ids=[rng.randint(1, 50) for _ in range(r)],
                    reward=rng.random(),
                    engine_logprobs=[-rng.random() for _ in range(r)],
                    weight_version=step,
                    index=i,
                    truncated=r == 300,
                    fields={"values": torch.randn(r)},
                )
            )
            buffer.append(
                samples[-1].prompt_ids,
                samples[-1].response_ids,
                samples[-1].engine_logprobs,
                samples[-1].fields,
                index=i,
                weight_version=step,
                truncated=r == 300,
                reward=samples[-1].reward,
            )
        order = list(range(200))
        rng.shuffle(order)
        (piece,) = buffer.cut([buffer.rows(order)])
        assert_same_batch(piece, PackedBatch.from_samples([samples[k] for k in order]))
        back = buffer.samples(buffer.rows(range(200)))
        assert [s.truncated for s in back] == [s.truncated for s in samples]
        buffer.clear()
    assert len(buffer) == 0


def test_a_kept_piece_is_never_overwritten_by_the_next_cut():
    buffer = PackedBuffer()
    for i in range(4):
        buffer.append([1, 2], [3, 4, 5], [-0.1] * 3, {}, index=i)
    (first,) = buffer.cut([[0, 1]])
    kept = first.input_ids.clone()
    buffer.clear()
    for i in range(4):
        buffer.append([9], [8, 7], [-0.2] * 2, {}, index=i)
    buffer.cut([[2, 3]])
    assert torch.equal(first.input_ids, kept)


def test_inconsistent_samples_are_refused():
    buffer = PackedBuffer()
    buffer.append([1], [2, 3], [-0.1, -0.2], {"values": [0.0, 1.0]}, index=0)
    with pytest.raises(ValueError, match="same fields"):
        buffer.append([1], [2], [-0.1], {}, index=1)
    with pytest.raises(ValueError, match="same fields"):
        buffer.append([1], [2], None, {"values": [0.0]}, index=1)
    with pytest.raises(ValueError, match="values for 2 response tokens"):
        buffer.append([1], [2, 3], [-0.1], {"values": [0.0, 1.0]}, index=1)
    with pytest.raises(ValueError, match="empty prompt"):
        buffer.append([], [2], [-0.1], {"values": [0.0]}, index=1)
    with pytest.raises(ValueError, match="does not hold"):
        buffer.rows([5])


def _check_plan(plan, lengths, budget, num_ranks):
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget and mb == sorted(mb)
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths, default=0)


@pytest.mark.parametrize("seed", range(25))
def test_grouped_plan_keeps_the_guarantees_and_the_micro_batch_count(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(0, 120))]
    budget = max(lengths, default=1) + rng.choice([0, 10, 100, 400])
    num_ranks = rng.randint(1, 4)
    groups = (
        [rng.randrange(3) for _ in lengths]
        if seed % 2
        else [i * 4 // max(len(lengths), 1) for i in range(len(lengths))]
    )
    plain = plan_token_budget_micro_batches(lengths, budget, num_ranks)
    grouped = plan_token_budget_micro_batches(lengths, budget, num_ranks, groups)
    _check_plan(grouped, lengths, budget, num_ranks)
    # At most one micro-batch more per further group than without groups.
    assert len(grouped[0]) <= len(plain[0]) + len(set(groups)) - 1 if lengths else grouped == plain
    # Same ranks, same loads: the groups change only how a rank's sequences form micro-batches.
    assert [sorted(i for mb in r for i in mb) for r in grouped] == [sorted(i for mb in r for i in mb) for r in plain]


def test_grouped_plan_keeps_most_micro_batches_within_one_engine():
    rng = random.Random(5)
    lengths = [min(8192, int(rng.lognormvariate(7.4, 1.0)) + 100) for _ in range(1024)]
    held = [[i for p in chunk for i in range(p * 16, (p + 1) * 16)] for chunk in prompt_chunks(64, 4)]
    plan = plan_packed(list(range(1024)), lengths, 16 * 8192, 4, held, steps=1)
    owner = {i: e for e, h in enumerate(held) for i in h}
    mbs = [mb for rank in plan for mb in rank if mb]
    within = [mb for mb in mbs if len({owner[i] for i in mb}) == 1]
    assert sum(lengths[i] for mb in within for i in mb) >= 0.8 * sum(lengths)
    assert len(plan[0]) <= len(plan_packed(list(range(1024)), lengths, 16 * 8192, 4, steps=1)[0]) + 3


def test_grouped_plan_of_complementary_groups_falls_back_to_mixed_micro_batches():
    # Group 0 only 6-token, group 1 only 4-token sequences, budget 10: kept apart they would need
    # 1.5x the micro-batches; the rank is packed as without groups instead.
    lengths = [6] * 8 + [4] * 8
    groups = [0] * 8 + [1] * 8
    plan = plan_token_budget_micro_batches(lengths, 10, 1, groups)
    _check_plan(plan, lengths, 10, 1)
    assert len(plan[0]) == len(plan_token_budget_micro_batches(lengths, 10, 1)[0]) == 8


def test_micro_batches_within_one_piece_are_views_that_take_new_fields():
    prompt_ids = synthetic_prompts(PROMPTS, 40, vocab_size=100)
    want = _reference(prompt_ids)
    held = [[i for p in chunk for i in range(p * SPP, (p + 1) * SPP)] for chunk in prompt_chunks(PROMPTS, 2)]
    engines = []
    for e, chunk in enumerate(prompt_chunks(PROMPTS, 2)):
        engine = _engine()
        engine.produce_and_hold(whole_prompt_requests(chunk, SPP), _job(chunk, prompt_ids))
        engines.append(engine)
    lengths = {i: len(s.prompt_ids) + len(s.response_ids) for i, s in want.items()}
    plan = _engine_ordered(plan_packed(list(lengths), list(lengths.values()), 120, 2, held, steps=1), held)
    cut = pieces_per_engine(plan, held)
    pieces = [engine.cut_for_ranks(members) for engine, members in zip(engines, cut)]
    views = 0
    for rank in range(2):
        mbs = assemble_packed([p[rank] for p in pieces], plan[rank], 0)
        assert [mb.indices.tolist() for mb in mbs] == plan[rank]
        for mb, members in zip(mbs, plan[rank]):
            assert_same_batch(mb, PackedBatch.from_samples([want[i] for i in members]))
            sources = [p[rank] for p in pieces if p[rank] is not None and set(members) & set(p[rank].indices.tolist())]
            if len(sources) == 1:  # within one engine's piece: a view of it, no copy
                base = sources[0].input_ids.untyped_storage().data_ptr()
                assert mb.input_ids.untyped_storage().data_ptr() == base
                views += 1
        for k, mb in enumerate(mbs):  # what the trainer does: (re)place keys per micro-batch
            mb.fields["old_logprobs"] = torch.full_like(mb.fields[ENGINE_LOGPROBS], float(k))
            mb.fields["ref_logprobs_new"] = torch.full_like(mb.fields[ENGINE_LOGPROBS], -float(k))
        for k, (mb, members) in enumerate(zip(mbs, plan[rank])):
            assert torch.equal(mb.fields["old_logprobs"], torch.full_like(mb.fields[ENGINE_LOGPROBS], float(k)))
            assert torch.equal(mb.fields["ref_logprobs_new"], torch.full_like(mb.fields[ENGINE_LOGPROBS], -float(k)))
            untouched = PackedBatch.from_samples([want[i] for i in members])
            assert all(torch.equal(mb.fields[n], v) for n, v in untouched.fields.items() if n != "old_logprobs")
        for p in pieces:  # the pieces the views come from are unchanged
            if p[rank] is not None:
                assert_same_batch(p[rank], PackedBatch.from_samples([want[i] for i in p[rank].indices.tolist()]))
    assert views > 0


def test_layout_with_engines_matches_the_plain_layout_sample_for_sample():
    prompt_ids = synthetic_prompts(PROMPTS, 40, vocab_size=100)
    samples = list(_reference(prompt_ids).values())
    held = [[i for p in chunk for i in range(p * SPP, (p + 1) * SPP)] for chunk in prompt_chunks(PROMPTS, 3)]
    for shards in (PackedTransfer(token_budget=150).layout(samples, 2, 4, 0, held_by_engine=held),):
        back = sorted(
            (s.index, s.response_ids.tolist())
            for shard in shards
            for mb in shard
            for s in mb.to_samples()
            if s.index >= 0
        )
        assert back == sorted((s.index, torch.as_tensor(s.response_ids).tolist()) for s in samples)


class _UpdatedMidway(SyntheticEngine):
    """pipeline=async: every sequence started with v3; an update to v4 reached the odd ones while
    they generated (the engine holds v4 when the rollout is made up)."""

    def _complete(self, requests, job):
        self.weight_version = 4
        for done in super()._complete(requests, job):
            for c in done:
                c.weight_version, c.interrupted = 3, bool(c.index % 2)
                c.token_version_mean = 3.5 if c.interrupted else 3.0
                c.version_spans = ((0, 2, 3), (2, len(c.response_ids), 4)) if c.interrupted else None
            yield done


def test_every_transfer_labels_a_sample_with_the_version_it_started_with_and_counts_the_interrupted(tmp_path):
    """The padded path (samples made up on the engine, `rollout_meta`; micro_batched makes its
    tickets' metadata the same way, not run here: it needs Ray) labels each sample as the packed one does: the version that drew its first token, not the engine's
    version when the rollout was made up; interrupted sequences and per-token versions counted."""
    from rlhf_orch.transfer.engine_side import rollout_meta

    prompt_ids = synthetic_prompts(PROMPTS, 40, 100)
    requests, job = whole_prompt_requests(range(PROMPTS), SPP), _job(range(PROMPTS), prompt_ids)
    samples, _ = _UpdatedMidway(LengthModel(mean=25, max_len=70), vocab_size=100).produce_samples(requests, job)
    padded = rollout_meta(samples)
    packed = _UpdatedMidway(LengthModel(mean=25, max_len=70), vocab_size=100).produce_and_hold(requests, job)
    n = PROMPTS * SPP
    for meta in (padded, packed):
        assert (
            meta.weight_versions == [3] * n
            and meta.interrupted == [bool(i % 2) for i in range(n)]
            and meta.interrupted_count == n // 2
        )
        assert meta.token_version_means == [3.5 if i % 2 else 3.0 for i in range(n)]
        # each token's version, as vLLM labelled it (what the rollout dump shows per token)
        lens = dict(zip(meta.indices, meta.response_lens))
        assert meta.version_spans == [((0, 2, 3), (2, lens[i], 4)) if i % 2 else None for i in range(n)]
