"""The rollout record (`RolloutMeta`): one piece of code filters, merges and carries every per-sample
field, and DAPO's dynamic sampling keeps each kept sample's own facts (its length above all, which
the overlong penalty reads) on both committed DAPO experiments' shapes."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from hydra.utils import instantiate

from rlhf_orch.orchestration.loop import sample_values_by_index
from rlhf_orch.orchestration import dynamic_sampling
from rlhf_orch.orchestration.dynamic_sampling import GroupFilter
from rlhf_orch.transfer.base import RolloutRequest
from rlhf_orch.transfer.packed import PackedTransfer
from rlhf_orch.transfer.plan import group_of, prompt_chunks
from rlhf_orch.transfer.rollout_meta import RolloutMeta, RolloutMetaError
from tests.conftest import compose_config

PER_SAMPLE = [f for f in dataclasses.fields(RolloutMeta) if f.metadata.get("per_sample")]


def _row_values(name: str, index: int):
    """A value of field `name` for the sample `index`, distinct per index (so a shift shows)."""
    hints = typing.get_type_hints(RolloutMeta)
    inner = typing.get_args(hints[name])[0] if typing.get_origin(hints[name]) is not list else hints[name]
    kind = typing.get_args(inner)[0] if typing.get_args(inner) else inner
    if name == "indices":
        return index
    if name == "env_stats":
        return {"turns": float(index), "masked": 0.0}
    if name == "env_metrics":
        return ("Env", {"i": index})
    if kind is bool:
        return index % 3 == 0
    if kind is int:
        return 1000 + index
    return 0.5 + index


def _meta(indices: list[int]) -> RolloutMeta:
    return RolloutMeta(**{f.name: [_row_values(f.name, i) for i in indices] for f in PER_SAMPLE})


def test_every_list_field_of_the_record_is_declared_per_sample():
    """A per-sample field added without the declaration would be dropped by select and merge: the
    record's list fields are all declared."""
    hints = typing.get_type_hints(RolloutMeta)
    lists = {name for name, hint in hints.items() if "list" in str(hint)}
    assert lists == {f.name for f in PER_SAMPLE}


def test_select_and_merge_carry_every_per_sample_field_with_its_own_sample():
    meta = _meta(list(range(10)))
    kept = meta.where(lambda i: i in (2, 3, 7))
    for f in PER_SAMPLE:
        assert getattr(kept, f.name) == [_row_values(f.name, i) for i in (2, 3, 7)], f.name
    merged = RolloutMeta.merge([_meta([5, 1]), _meta([0, 4]), _meta([])])
    assert merged.indices == [0, 1, 4, 5]
    for f in PER_SAMPLE:
        assert getattr(merged, f.name) == [_row_values(f.name, i) for i in (0, 1, 4, 5)], f.name


def test_a_record_whose_lists_disagree_in_length_is_refused():
    with pytest.raises(RolloutMetaError, match="model_token_lens has 2 values for 4 samples"):
        RolloutMeta(
            indices=[0, 1, 2, 3], seq_lens=[1] * 4, response_lens=[1] * 4, rewards=[0.0] * 4, model_token_lens=[5, 6]
        )
    with pytest.raises(RolloutMetaError, match="the same sample twice"):
        RolloutMeta.merge([_meta([1, 2]), _meta([2])])


def test_an_empty_field_is_filled_per_row_and_totals_follow_the_samples():
    meta = RolloutMeta(
        indices=[0, 1],
        seq_lens=[9, 8],
        response_lens=[4, 3],
        rewards=[1.0, 0.0],
        weight_versions=[2, 3],
        env_stats=[{"turns": 2.0}, {"turns": 3.0, "masked": 1.0}],
        interrupted=[True, False],
    )
    assert (
        meta.model_token_lens == [4, 3] and meta.token_version_means == [2.0, 3.0] and meta.truncated == [False, False]
    )
    assert meta.env_stats_total() == {"turns": 5.0, "masked": 1.0} and meta.interrupted_count == 1
    assert meta.masked == [False, True]
    only_first = meta.select([0])
    assert only_first.env_stats_total() == {"turns": 2.0} and only_first.interrupted_count == 1


# --------------------------------------------------------------------------- DAPO on its experiments' shapes
def _experiment_shape(name: str):
    cfg = compose_config([f"experiment={name}", "algo.dynamic_sampling=true"])
    return (
        cfg,
        cfg.algo.rollout_batch_size,
        cfg.algo.samples_per_prompt,
        cfg.placement.engines,
        cfg.data.response_max_len,
    )


def _length(index: int, response_max_len: int) -> int:
    """Each sample's own model-token length: spread over the overlong buffer, different per index."""
    return response_max_len - (index * 7919) % 6000


class _ScriptedEngines:
    """Engines whose samples are known in advance: group g is uniform (all 0) when g % 3 == 0 (DAPO
    drops it), its samples' lengths and env facts are their own. Per round, per engine: the meta an
    engine would return for its chunk (`PackedTransfer._generate`'s contract)."""

    def __init__(self, spp: int, response_max_len: int, engines: int):
        self.spp, self.max_len, self.engines = spp, response_max_len, [object() for _ in range(engines)]

    def meta_of(self, prompts: range) -> RolloutMeta:
        indices = [p * self.spp + s for p in prompts for s in range(self.spp)]
        return RolloutMeta(
            indices=indices,
            seq_lens=[100 + _length(i, self.max_len) for i in indices],
            response_lens=[_length(i, self.max_len) + 3 for i in indices],  # + observation tokens
            rewards=[0.0 if group_of(i, self.spp) % 3 == 0 else float(i % 2) for i in indices],
            model_token_lens=[_length(i, self.max_len) for i in indices],
            env_stats=[{"turns": 1.0, "tool_calls": float(i % 5)} for i in indices],
            env_metrics=[("Env", {"i": i}) for i in indices],
            interrupted=[i % 4 == 0 for i in indices],
        )

    def generate(self, request: RolloutRequest, route, prompts: range) -> list[list[RolloutMeta]]:
        chunks = [
            range(prompts.start + c.start, prompts.start + c.stop)
            for c in prompt_chunks(len(prompts), len(self.engines))
        ]
        return [[self.meta_of(c)] if len(c) else [] for c in chunks]


@pytest.mark.parametrize("experiment", ["dapo_qwen25_math_7b", "dapo_qwen25_32b_reference"])
def test_dynamic_sampling_keeps_each_kept_sample_s_own_length_and_counts(experiment, monkeypatch):
    """After dropped groups the kept samples carry their own lengths into DAPO's overlong penalty
    and advantages, and the step's counters (interrupted, env counters, env metrics) count the kept
    samples only."""
    cfg, prompts, spp, engines, max_len = _experiment_shape(experiment)
    algo = instantiate(cfg.algo)
    scripted = _ScriptedEngines(spp, max_len, engines)
    drawn = iter(range(10**6))
    more = lambda n: [dataclasses.make_dataclass("P", ["prompt_ids", "i"])([1, 2], next(drawn)) for _ in range(n)]  # noqa: E731
    request = RolloutRequest(
        prompts=more(prompts),
        prompt_ids=[[1, 2]] * prompts,
        samples_per_prompt=spp,
        max_tokens=max_len,
        temperature=1.0,
        scorer=None,
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=max_len + 100,
    )
    monkeypatch.setattr(PackedTransfer, "_generate", staticmethod(scripted.generate))
    group_filter = GroupFilter(keep=algo.keep_groups, more_prompts=more, max_rounds=algo.max_gen_batches)
    held = dynamic_sampling.generate(
        PackedTransfer(token_budget=0), request, type("R", (), {"engines": scripted.engines})(), group_filter
    )
    meta = held.meta

    assert held.dropped_groups > 0 and len(meta.indices) == prompts * spp
    assert all(group_of(i, spp) % 3 for i in meta.indices)  # only informative groups were kept
    assert meta.model_token_lens == [_length(i, max_len) for i in meta.indices]
    assert meta.response_lens == [_length(i, max_len) + 3 for i in meta.indices]
    assert meta.interrupted_count == sum(i % 4 == 0 for i in meta.indices)
    assert meta.env_stats_total() == {
        "turns": float(len(meta.indices)),
        "tool_calls": float(sum(i % 5 for i in meta.indices)),
    }
    assert [m[1]["i"] for m in meta.env_metrics_list()] == meta.indices

    values, stats = sample_values_by_index(algo, meta, spp, max_len)
    lengths = torch.tensor([_length(i, max_len) for i in meta.indices])
    expected, expected_stats = algo.sample_values(
        torch.tensor(meta.rewards), torch.tensor([group_of(i, spp) for i in meta.indices]), lengths, max_len
    )
    assert [values[i] for i in meta.indices] == pytest.approx(expected.tolist())
    assert stats["reward/overlong_penalty"] == pytest.approx(expected_stats["reward/overlong_penalty"]) != 0


def test_a_masked_trajectory_counts_in_no_group_statistics():
    """env.mask_failed / mask_truncated: the masked sample gets 0 and its siblings' advantages are
    those of the group without it (veRL and SkyRL leave such samples out of the mean and std)."""
    algo = instantiate(compose_config(["algo=grpo"]).algo)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    stats = [None, {"masked": 1.0}, None, None, None, None]
    meta = RolloutMeta(
        indices=list(range(6)), seq_lens=[5] * 6, response_lens=[3] * 6, rewards=rewards, env_stats=stats
    )
    values, _ = sample_values_by_index(algo, meta, 3, 16)
    alone, _ = algo.sample_values(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 3]), 16)
    assert values[1] == 0.0
    assert [values[0], values[2]] == pytest.approx(alone.tolist())
    rest, _ = algo.sample_values(torch.tensor(rewards[3:]), torch.tensor([1, 1, 1]), torch.tensor([3, 3, 3]), 16)
    assert [values[3], values[4], values[5]] == pytest.approx(rest.tolist())


def _dapo_with_engine_1_replaced_in_round_2(scripted: _ScriptedEngines, monkeypatch) -> tuple:
    """DAPO's rounds over six prompts on `scripted`'s two engines, engine 1 dying in round 2 and
    replaced there (as `on_engines` does): the held rollout and the route it ends on."""
    from types import SimpleNamespace

    rounds = []

    def generate(request, route, prompts):
        rounds.append(prompts)
        if len(rounds) == 2:
            route.engines[1] = object()  # engine 1 died in round 2 and was replaced (on_engines)
        return scripted.generate(request, route, prompts)

    algo = instantiate(compose_config(["algo=dapo"]).algo)
    drawn = iter(range(10**6))
    more = lambda n: [dataclasses.make_dataclass("P", ["prompt_ids", "i"])([1, 2], next(drawn)) for _ in range(n)]  # noqa: E731
    request = RolloutRequest(
        prompts=more(6),
        prompt_ids=[[1, 2]] * 6,
        samples_per_prompt=scripted.spp,
        max_tokens=64,
        temperature=1.0,
        scorer=None,
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=70,
    )
    monkeypatch.setattr(PackedTransfer, "_generate", staticmethod(generate))
    route = SimpleNamespace(engines=list(scripted.engines))
    group_filter = GroupFilter(keep=algo.keep_groups, more_prompts=more, max_rounds=4)
    return dynamic_sampling.generate(PackedTransfer(token_budget=0), request, route, group_filter), route


def test_an_engine_replaced_in_a_later_sampling_round_loses_its_earlier_rounds_and_the_pipeline_decides(monkeypatch):
    """DAPO: engine 1 dies in round 2 and is replaced (its round-2 share re-issued there); its
    round-1 samples died with it. The held rollout says so (`shares`): under pipeline=sync the loop
    treats it as a lost process (EngineDiedError: the run restarts from its checkpoint, which
    repeats the uninterrupted run) -- it was a plain RuntimeError that ended the run; under async
    the lost share is drawn again on the replacement."""
    from types import SimpleNamespace

    from rlhf_orch.orchestration.fleet import EngineFleet
    from rlhf_orch.orchestration.loop import EngineDiedError
    from rlhf_orch.orchestration.pipeline import AsyncPipeline, SyncPipeline

    spp, engines = 4, 2
    scripted = _ScriptedEngines(spp, 64, engines)
    held, route = _dapo_with_engine_1_replaced_in_round_2(scripted, monkeypatch)
    assert held.rounds == 2 and held.shares[1][0].engine is scripted.engines[1]  # round 1's share: the dead process
    assert all(share.prompts for share in held.shares[1])  # (its round-2 groups, all dropped, left no share)

    redrawn = []

    def redraw(held, route, lost):  # (what PackedTransfer.redraw leaves: the lost shares made by the replacements)
        redrawn.append(lost)
        for e in lost:
            held.shares[e] = [dataclasses.replace(share, engine=route.engines[e]) for share in held.shares[e]]
        return 0

    transfer = SimpleNamespace(redraw=redraw)
    for pipeline in (SyncPipeline(), AsyncPipeline(max_staleness=1)):
        loop = SimpleNamespace(
            pipeline=pipeline,
            transfer=transfer,
            _restart_s={},
            _redrawn={},
            _replace_engine=lambda e, step, dead=None: None,
        )
        if not pipeline.redraws_lost_shares:
            with pytest.raises(EngineDiedError, match="vLLM engine 1 lost after making its share of step 0's rollout"):
                EngineFleet.redraw_lost_shares(loop, held, route)
        else:
            EngineFleet.redraw_lost_shares(loop, held, route)
        pipeline.close(None)
    assert redrawn == [[1]]


def test_an_engine_replaced_after_all_its_earlier_groups_were_dropped_lost_nothing(monkeypatch):
    """DAPO: every group engine 1 made in round 1 is uniform (dropped); it dies in round 2 and is
    replaced there. Nothing the step trains on went with it: no share is lost, under any pipeline
    (a share left with no kept prompt was counted lost before, and restarted the run)."""
    from types import SimpleNamespace

    from rlhf_orch.orchestration.fleet import EngineFleet
    from rlhf_orch.orchestration.pipeline import SyncPipeline

    class EngineOnesRoundOneUniform(_ScriptedEngines):
        def meta_of(self, prompts: range) -> RolloutMeta:
            meta = super().meta_of(prompts)
            meta.rewards = [0.0 if group_of(i, self.spp) in (3, 4, 5) else float(i % 2) for i in meta.indices]
            return meta

    spp = 4
    scripted = EngineOnesRoundOneUniform(spp, 64, 2)
    held, route = _dapo_with_engine_1_replaced_in_round_2(scripted, monkeypatch)
    assert held.rounds == 2 and sorted({group_of(i, spp) for i in held.meta.indices}) == [0, 1, 2, 6, 7, 8]
    assert all(share.engine is route.engines[1] for share in held.shares[1])
    loop = SimpleNamespace(pipeline=SyncPipeline(), transfer=None, _restart_s={}, _redrawn={})
    EngineFleet.redraw_lost_shares(loop, held, route)  # (raised EngineDiedError: a lost process)


def test_a_checkpoint_written_before_the_record_moved_loads_with_its_counts_kept(tmp_path, monkeypatch):
    """driver.pt of an earlier version pickled RolloutMeta as rlhf_orch.transfer.engine_side.RolloutMeta
    with the counts as totals (interrupted an int, env_stats one dict): it loads as data only, the
    totals kept, per sample -- and the old masked count marks no sample."""
    import rlhf_orch.transfer.engine_side as engine_side
    from rlhf_orch.orchestration.checkpoint import load_driver_state

    old = RolloutMeta(indices=[0, 1, 2], seq_lens=[3] * 3, response_lens=[1] * 3, rewards=[1.0, 0.0, 1.0])
    old.__dict__.update(interrupted=2, env_stats={"turns": 6.0, "masked": 1.0}, env_metrics=[("Env", {"x": 1})])
    monkeypatch.setattr(RolloutMeta, "__module__", "rlhf_orch.transfer.engine_side")  # pickled under the old name
    monkeypatch.setattr(engine_side, "RolloutMeta", RolloutMeta, raising=False)
    torch.save({"pending_rollout": old}, tmp_path / "driver.pt")
    monkeypatch.undo()
    loaded = load_driver_state(tmp_path / "driver.pt")["pending_rollout"]
    assert loaded.interrupted_count == 2 and loaded.env_stats_total() == {"turns": 6.0}
    assert loaded.masked == [False, False, False] and len(loaded.env_metrics) == 3


def test_dynamic_sampling_judges_a_group_by_its_unmasked_samples(monkeypatch):
    """A group whose only differing score is a masked trajectory's (an infrastructure failure that
    trains nothing) carries no signal: DAPO's filter drops it like any uniform group."""
    spp = 3
    algo = instantiate(compose_config(["algo=dapo"]).algo)
    rounds = iter([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]])

    def generate(request, route, prompts):
        indices = [p * spp + s for p in prompts for s in range(spp)]
        stats = [{"masked": 1.0} if i == 2 else None for i in indices]  # group 0's differing score is masked
        return [
            [
                RolloutMeta(
                    indices=indices, seq_lens=[3] * 6, response_lens=[1] * 6, rewards=next(rounds), env_stats=stats
                )
            ]
        ]

    drawn = iter(range(100))
    more = lambda n: [dataclasses.make_dataclass("P", ["prompt_ids", "i"])([1], next(drawn)) for _ in range(n)]  # noqa: E731
    request = RolloutRequest(
        prompts=more(2),
        prompt_ids=[[1]] * 2,
        samples_per_prompt=spp,
        max_tokens=4,
        temperature=1.0,
        scorer=None,
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=8,
    )
    monkeypatch.setattr(PackedTransfer, "_generate", staticmethod(generate))
    group_filter = GroupFilter(keep=algo.keep_groups, more_prompts=more, max_rounds=4)
    held = dynamic_sampling.generate(
        PackedTransfer(token_budget=0), request, type("R", (), {"engines": [object()]})(), group_filter
    )
    kept_groups = sorted({group_of(i, spp) for i in held.meta.indices})
    assert 0 not in kept_groups and kept_groups == [1, 2] and held.rounds == 2
