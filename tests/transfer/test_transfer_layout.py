"""Pure checks of the three strategies' layouts and the planners behind them (no Ray)."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, Sample
from rlhf_orch.transfer.inbox import assemble_packed
from rlhf_orch.transfer.micro_batched import MicroBatchedTransfer
from rlhf_orch.transfer.packed import PackedTransfer
from rlhf_orch.transfer.padded import PaddedTransfer
from rlhf_orch.transfer.plan import (
    extra_sequence_index,
    group_of,
    pieces_per_engine,
    plan_count_micro_batches,
    plan_packed,
    prompt_chunks,
    requests_for_indices,
    trajectory_of,
)

PAD = 0
STRATEGIES = {
    "padded": PaddedTransfer(),
    "micro_batched": MicroBatchedTransfer(max_in_flight=4),
    "packed": PackedTransfer(token_budget=64),
}


def _samples(n: int = 24, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 12), rng.choice([0, 1, 3, 9, 20, 40])
        out.append(
            Sample(
                prompt_ids=[rng.randint(1, 40) for _ in range(p)],
                response_ids=[rng.randint(1, 40) for _ in range(r)],
                reward=rng.uniform(0, 1),
                engine_logprobs=[-rng.random() for _ in range(r)],
                weight_version=3,
                index=i,
                fields={"values": [rng.random() for _ in range(r)], "advantages": [rng.random() for _ in range(r)]},
            )
        )
    return out


def _f32(values) -> list[float]:
    return torch.as_tensor(values, dtype=torch.float32).tolist()


def _key(s: Sample) -> tuple:
    return (
        s.index,
        torch.as_tensor(s.prompt_ids).tolist(),
        torch.as_tensor(s.response_ids).tolist(),
        _f32([s.reward]),
        _f32(s.engine_logprobs),
        {k: _f32(v) for k, v in sorted(s.fields.items())},
        s.weight_version,
    )


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_round_trip_every_field_of_every_sample(name, num_shards):
    samples = _samples()
    shards = STRATEGIES[name].layout(samples, num_shards, 4, PAD)
    assert len(shards) == num_shards
    back = [s for shard in shards for mb in shard for s in mb.to_samples() if s.index >= 0]
    # Nothing lost, nothing duplicated, and each sample's order is known by its index.
    assert sorted(s.index for s in back) == list(range(len(samples)))
    assert sorted(map(_key, back)) == sorted(map(_key, samples))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_padding_never_on_the_wire_for_packed(name):
    samples = _samples()
    shards = STRATEGIES[name].layout(samples, 2, 4, PAD)
    real = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    wire = sum(int(mb.input_ids.numel()) for shard in shards for mb in shard)
    if name == "packed":
        assert wire == real
    else:
        assert wire >= real


def test_packed_micro_batches_respect_budget_and_balance_ranks():
    samples = _samples(64, seed=3)
    shards = PackedTransfer(token_budget=64).layout(samples, 4, 4, PAD)
    counts = {len(shard) for shard in shards}
    assert len(counts) == 1  # same number of micro-batches on every rank
    for shard in shards:
        for mb in shard:
            assert isinstance(mb, PackedBatch) and mb.num_tokens <= 64
    loads = [sum(mb.num_tokens for mb in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(len(s.prompt_ids) + len(s.response_ids) for s in samples)


@pytest.mark.parametrize("lengths", ["uniform_short", "ragged", "one_long"])
def test_each_optimizer_step_packs_its_own_sequences_under_a_token_budget(lengths):
    """TinyZero's shape: 256 sequences over 2 ranks, 64 per optimizer step (4 steps), a 16384-token
    budget. Each rank's sequences are cut into 4 runs of 32 by count first (veRL's mini-batches),
    each packed on its own to the same number of micro-batches, so the trainers' step plan takes
    exactly those runs as its 4 steps -- packed over the whole rank, short sequences made 1-3
    micro-batches (that many optimizer steps), and steps followed the packer's length order. A
    sequence far longer than the others keeps every rank at 4 steps too (stand-ins where a run is
    empty)."""
    import random as random_lengths

    from rlhf_orch.trainer.token_weighting import plan_optimizer_steps
    from rlhf_orch.transfer.micro_batches import near_equal_ranges

    rng = random_lengths.Random(0)
    n, tbs, budget = 256, 64, 16384
    length_of = {
        "uniform_short": lambda i: 150,
        "ragged": lambda i: rng.randint(200, 550),
        "one_long": lambda i: 9000 if i == 7 else 50,
    }[lengths]
    samples = [
        Sample(prompt_ids=[1] * 10, response_ids=[2] * (length_of(i) - 10), reward=0.0, index=i) for i in range(n)
    ]
    shards = PackedTransfer(token_budget=budget).layout(samples, 2, 8, PAD, train_batch_size=tbs)
    assert len({len(shard) for shard in shards}) == 1 and len(shards[0]) % 4 == 0
    steps = []
    for shard in shards:
        held = sorted(i for mb in shard for i in mb.indices.tolist() if i >= 0)
        # (the ranks' all-reduced count makes the rollout's 4 steps; one rank alone: its share / 4)
        plan = plan_optimizer_steps(shard, train_batch_size=len(held) // 4, world_size=1)
        steps.append(plan)
        assert plan.num_steps == 4 and all(mb.num_tokens <= budget for mb in shard)
        runs = [[held[k] for k in part] for part in near_equal_ranges(len(held), 4)]  # near-equal runs by count
        assert [sorted(members) for members in plan.members] == runs
    if lengths != "one_long":
        assert all(len(members) == 32 for plan in steps for members in plan.members)


def test_micro_batched_pads_per_micro_batch_padded_to_global_max():
    samples = _samples()
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for mb in PaddedTransfer().layout(samples, 2, 4, PAD)[0]:
        assert isinstance(mb, PaddedBatch) and mb.input_ids.shape[1] == longest
    for mb in MicroBatchedTransfer(max_in_flight=4).layout(samples, 2, 4, PAD)[0]:
        assert mb.input_ids.shape[1] == int(mb.seq_lens.max())


def test_sequence_longer_than_budget_is_a_clear_error():
    samples = _samples()
    with pytest.raises(ValueError, match=r"exceed transfer.token_budget=8.*set transfer.token_budget >= \d+"):
        PackedTransfer(token_budget=8).layout(samples, 1, 4, PAD)


def test_token_budget_zero_derives_micro_batch_size_times_longest():
    samples = _samples()
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for mb in PackedTransfer(token_budget=0).layout(samples, 1, 4, PAD)[0]:
        assert mb.num_tokens <= 4 * longest


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_batch_that_does_not_divide_over_ranks_is_refused(name):
    with pytest.raises(ValueError, match="do not divide evenly over 3 data-parallel ranks"):
        STRATEGIES[name].layout(_samples(8), 3, 4, PAD)


def _with_further_sequences(n: int = 24) -> list[Sample]:
    """`n` trajectories, five of which train as more than one sequence (env=agent)."""
    samples = _samples(n)
    extra = [(3, 1), (3, 2), (10, 1), (17, 1), (n - 1, 1)]
    for k, (trajectory, j) in enumerate(extra):
        s = _samples(n + len(extra), seed=1)[n + k]
        s.index = extra_sequence_index(trajectory, j)
        samples.append(s)
    return samples


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_trajectories_with_further_sequences_train_every_sequence_in_lockstep(name, num_shards):
    """A trajectory's further sequences make the count uneven over the ranks: every sequence still
    lands exactly once, and every rank gets the same number of micro-batches (they step together)."""
    samples = _with_further_sequences()
    shards = STRATEGIES[name].layout(samples, num_shards, 4, PAD)
    assert len({len(shard) for shard in shards}) == 1
    back = [s for shard in shards for mb in shard for s in mb.to_samples() if s.index >= 0]
    assert sorted(map(_key, back)) == sorted(map(_key, samples))
    if name != "packed":  # count-based: at most one sequence over the micro-batch size
        assert max(len(mb) for shard in shards for mb in shard) <= 5
    # The divisibility rule is on trajectories, as without further sequences.
    with pytest.raises(ValueError, match="do not divide evenly over 3 data-parallel ranks"):
        STRATEGIES[name].layout(_with_further_sequences(8), 3, 4, PAD)


def test_a_further_sequence_names_its_trajectory_and_group():
    i = extra_sequence_index(13, 2)
    assert trajectory_of(i) == 13 and group_of(i, 4) == 3 and trajectory_of(13) == 13
    assert len({extra_sequence_index(t, k) for t in range(50) for k in range(1, 4)}) == 150
    with pytest.raises(ValueError):
        extra_sequence_index(13, 0)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_empty_responses_are_kept_with_no_action(name):
    samples = [Sample([1, 2], [], 0.5, [], index=0), Sample([3], [4, 5], 1.0, [-0.1, -0.2], index=1)]
    shards = STRATEGIES[name].layout(samples, 1, 2, PAD)
    back = {s.index: s for mb in shards[0] for s in mb.to_samples()}
    assert len(back[0].response_ids) == 0 and len(back[1].response_ids) == 2
    assert sum(int(mb.action_mask.sum()) for mb in shards[0]) == 2


def test_fewer_sequences_than_micro_batches_gives_explicit_empty_stand_ins():
    # Rank 0 gets the one long sequence split nowhere; rank 1 gets short ones: micro-batch counts
    # are equalised with a stand-in (index -1, no action) on the rank that runs out.
    samples = [Sample([1] * 30, [2] * 30, 0.0, index=0)] + [Sample([1], [2], 0.0, index=i) for i in range(1, 4)]
    shards = PackedTransfer(token_budget=60).layout(samples, 2, 1, PAD)
    assert len(shards[0]) == len(shards[1])
    stand_ins = [mb for shard in shards for mb in shard if mb.indices.tolist() == [-1]]
    for mb in stand_ins:
        assert int(mb.action_mask.sum()) == 0


def test_requests_cover_exactly_the_micro_batch_indices():
    for spp in (1, 3, 4):
        works = plan_count_micro_batches(num_prompts=6, samples_per_prompt=spp, num_shards=2, micro_batch_size=5)
        covered = sorted(i for w in works for r in w.requests for i in r.indices(spp))
        assert covered == list(range(6 * spp))
        for w in works:
            assert [i for r in w.requests for i in r.indices(spp)] == list(w.indices)
    assert requests_for_indices(range(3, 9), 4)[0].first_sample == 3


def test_engine_pieces_reassemble_the_planned_micro_batches():
    samples = _samples(32, seed=5)
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    plan = plan_packed([s.index for s in samples], lens, 64, 2, steps=1)
    held = [[i for p in chunk for i in range(p * 4, p * 4 + 4)] for chunk in prompt_chunks(8, 3)]
    cut = pieces_per_engine(plan, held)
    by_index = {s.index: s for s in samples}
    for rank in range(2):
        pieces = [
            PackedBatch.from_samples([by_index[i] for mb in cut[e][rank] for i in mb]) if any(cut[e][rank]) else None
            for e in range(3)
        ]
        mbs = assemble_packed(pieces, plan[rank], PAD)
        assert [mb.indices.tolist() for mb in mbs] == plan[rank]


def test_the_rollout_request_carries_the_optimizer_step_size_to_the_packing():
    """algo.train_batch_size reaches the packed hand-over: loop settings -> the rollout request
    (-> the held rollout, `PackedTransfer.generate`) -> `optimizer_steps` in `hand_over`."""
    import types

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlhf_orch.orchestration.loop import TrainLoop
    from rlhf_orch.orchestration.session import loop_settings
    from tests.conftest import compose_config

    cfg = compose_config(["algo.train_batch_size=8", "algo.micro_batch_size=4"])
    typed = OmegaConf.to_object(cfg)
    plan = instantiate(cfg.placement).plan(reward_model=False, critic=True, reference=True)
    settings = loop_settings(typed, plan, types.SimpleNamespace(sleep_level=0))
    assert settings.train_batch_size == 8
    loop = TrainLoop.__new__(TrainLoop)
    loop.settings, loop.env = settings, None
    loop.tokenizer = types.SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, **_: [])
    loop.reward = types.SimpleNamespace(rule=None)
    loop.actors = types.SimpleNamespace(policy=[object()])
    loop.algo = types.SimpleNamespace(uses_dynamic_sampling=False)
    assert loop._rollout_request([]).train_batch_size == 8


def test_redraw_makes_only_the_lost_shares_again_and_drops_every_row_of_their_prompts():
    """A held rollout's shares on engine 1: prompts 0-1 made by a process since replaced (lost),
    prompt 4 made by the current one (a later DAPO round: kept). The redraw draws prompts 0-1 again
    on the current process only; every old row of theirs goes -- a trajectory's further sequence
    too, which the new draw need not repeat -- and what engine 1 holds follows. A restored rollout's
    share is held again from its samples."""
    import types

    from rlhf_orch.transfer.base import EngineShare, HeldRollout, RolloutRequest
    from rlhf_orch.transfer.packed import PackedTransfer
    from rlhf_orch.transfer.plan import extra_sequence_index
    from rlhf_orch.transfer.rollout_meta import RolloutMeta

    spp = 2

    def meta_of(indices, reward):
        return RolloutMeta(
            indices=indices,
            seq_lens=[5] * len(indices),
            response_lens=[2] * len(indices),
            rewards=[reward] * len(indices),
        )

    calls = []

    class Engine:
        def __init__(self, name):
            self.name = name
            self.produce_and_hold = types.SimpleNamespace(remote=self.produce)
            self.hold_samples = types.SimpleNamespace(
                remote=lambda samples, slot: calls.append((self.name, "hold", len(samples), slot))
            )

        def produce(self, requests, job, slot):
            calls.append((self.name, "produce", [r.prompt_index for r in requests], slot))
            return meta_of([r.prompt_index * spp + k for r in requests for k in range(spp)], 1.0)

    dead, current, other = Engine("dead"), Engine("current"), Engine("engine0")

    class Route:
        engines = [other, current]

        def on_engines(self, submit, engines, what):
            return {e: submit(e, self.engines[e]) for e in engines}

    old_rows = [0, 1, extra_sequence_index(0, 1), 2, 3, 8, 9]  # prompts 0 and 1 (0 with a further sequence), and 4
    held = HeldRollout(
        meta=RolloutMeta.merge([meta_of(old_rows, 0.0), meta_of([4, 5, 6, 7], 0.5)]),
        held=[[4, 5, 6, 7], old_rows],
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=8,
        slot=3,
        request=RolloutRequest(
            prompts=list(range(5)),
            prompt_ids=[[1, 2]] * 5,
            samples_per_prompt=spp,
            max_tokens=4,
            temperature=1.0,
            scorer=None,
            num_shards=1,
            micro_batch_size=1,
            pad_id=0,
            max_seq_len=8,
        ),
        shares=[[EngineShare(other, [2, 3])], [EngineShare(dead, [0, 1]), EngineShare(current, [4])]],
    )
    assert PackedTransfer(token_budget=0).redraw(held, Route(), [1]) == 4
    assert calls == [("current", "produce", [0, 1], 3)]
    assert held.meta.indices == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # the further sequence of prompt 0 is gone
    assert held.meta.rewards == [1.0] * 4 + [0.5] * 4 + [0.0] * 2  # 0-3 drawn again, 8-9 (prompt 4) kept
    assert held.held[1] == [0, 1, 2, 3, 8, 9]
    assert [(s.engine.name, s.prompts) for s in held.shares[1]] == [("current", [4]), ("current", [0, 1])]

    calls.clear()
    restored = HeldRollout(
        meta=meta_of([0, 1], 0.0),
        held=[[], [0, 1]],
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=8,
        slot=2,
        samples=[[], ["s0", "s1"]],
        shares=[[EngineShare(other, [])], [EngineShare(dead, [])]],
    )
    assert PackedTransfer(token_budget=0).redraw(restored, Route(), [1]) == 2
    assert calls == [("current", "hold", 2, 2)] and restored.shares[1][0].engine is current

    # Engine 1 dies during the redraw: `on_engines` replaces it and the share is made on the new
    # process; the share it had kept (prompt 4) went with it, so the loop draws that one again too.
    from rlhf_orch.orchestration.fleet import EngineFleet
    from rlhf_orch.orchestration.pipeline import AsyncPipeline

    calls.clear()
    newer = Engine("newer")

    class RouteLosingEngine1(Route):
        def on_engines(self, submit, engines, what):
            if self.engines[1] is current:
                self.engines = [other, newer]  # (died mid-call: replaced, the call made again on the new one)
            return super().on_engines(submit, engines, what)

    held.shares = [[EngineShare(other, [2, 3])], [EngineShare(dead, [0, 1]), EngineShare(current, [4])]]
    route = RouteLosingEngine1()
    loop = types.SimpleNamespace(
        pipeline=AsyncPipeline(max_staleness=1),
        transfer=PackedTransfer(token_budget=0),
        _restart_s={},
        _redrawn={},
        _replace_engine=lambda e, step, dead=None: route.engines[e],
    )
    EngineFleet.redraw_lost_shares(loop, held, route)
    assert calls == [("newer", "produce", [0, 1], 3), ("newer", "produce", [4], 3)]
    assert all(share.engine is newer for share in held.shares[1]) and held.meta.indices == list(range(10))
    assert held.meta.rewards == [1.0] * 4 + [0.5] * 4 + [1.0] * 2 and loop._redrawn == {held.step: 6}
