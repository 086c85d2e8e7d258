"""What the train loop and the run record guarantee when overlap and faults meet, without Ray: a
weight push and an engine replacement never overlap; no checkpoint is written from a half-applied
update; a checkpoint's sampler position is the one after every draw of the rollouts it carries, and
a final checkpoint (which carries none) goes back to before the prompts drawn ahead; a restart
counts every engine replacement of the run; the same failure twice is a crash loop; a checkpoint
holding a rollout is not resumed under another pipeline or transfer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.app import check
from rlhf_orch.checkpoint_dirs import DRIVER_STATE, ResumeError
from rlhf_orch.orchestration.checkpoint import load_driver_state, load_resume
from rlhf_orch.orchestration.loop import LoopSettings, StepFailedError, TrainLoop
from rlhf_orch.orchestration.pipeline import OneStepOffPipeline, SyncPipeline
from rlhf_orch.orchestration.run_record import RunRecord
from rlhf_orch.orchestration.session import failure_signature
from tests.conftest import compose_config


class _Task:
    """A sampler: `consumed` prompts drawn so far."""

    def __init__(self) -> None:
        self.consumed = 0

    def sample_prompts(self, n: int) -> list[int]:
        self.consumed += n
        return list(range(self.consumed - n, self.consumed))

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


class _Logger:
    run_id = None

    def start(self, *args, **kwargs) -> None: ...
    def log(self, *args) -> None: ...
    def close(self, **kwargs) -> None: ...


def _get(refs, what, **kwargs):  # no Ray: the fake actors' calls return their results directly
    return list(refs)


def _loop(task: _Task, actors=None, sync=None, pipeline=None) -> TrainLoop:
    cfg = compose_config(["experiment=quick"])
    settings = LoopSettings(
        num_steps=4,
        rollout_batch_size=2,
        samples_per_prompt=2,
        micro_batch_size=2,
        response_max_len=8,
        temperature=1.0,
        seed=0,
        step_timeout_s=10.0,
        max_seq_len=0,
        max_engine_restarts=3,
        engine_tp=1,
        engines_sleep=False,
        min_response_len=0,
        train_batch_size=0,
        corrects_engine_sampling=False,
    )
    actors = actors or SimpleNamespace(engines=[], policy=[], critic=[], reference=[], own_reference=[], reward=[])
    loop = TrainLoop(actors, task, None, None, sync, instantiate(cfg.algo), settings, None, pipeline or SyncPipeline())
    loop._get = loop.fleet._get = _get
    loop._rollout_request = lambda prompts: SimpleNamespace(prompts=prompts)  # the prompts are all these tests look at
    return loop


def _record(run_dir: Path, task: _Task, *overrides: str) -> RunRecord:
    cfg = compose_config(["experiment=quick", *overrides])
    typed, _ = check(cfg, instantiate(cfg.launcher))
    return RunRecord(run_dir, typed, OmegaConf.to_container(cfg, resolve=True), _Logger(), task, None)


NO_ACTORS = SimpleNamespace(policy=[], critic=[])  # a checkpoint of no trainer ranks: the driver's state only


def test_a_weight_push_and_an_engine_replacement_never_overlap(monkeypatch):
    """The main thread pushes the trainers' new weights while a rollout thread (async) replaces a
    dead engine, which re-forms the weight groups: the re-forming waits for the push."""
    from rlhf_orch.orchestration import fleet as loop_module

    monkeypatch.setattr(
        loop_module, "dead_or_stuck", lambda engines, timeout_s: ([], [])
    )  # (no Ray: every engine answers)
    monkeypatch.setattr(loop_module, "dead_actors", lambda engines, timeout_s: [])
    events: list[str] = []
    pushing = threading.Event()

    class Sync:
        pushing = False

        def push(self, version):
            self.pushing = True
            events.append(f"push v{version} start")
            pushing.set()
            time.sleep(0.3)
            events.append(f"push v{version} end")
            self.pushing = False

        def verify(self, version): ...

        def prepare(self, policy, engines, tp):
            events.append("prepare" + (" DURING A PUSH" if self.pushing else ""))

    engine = SimpleNamespace(reseed=SimpleNamespace(remote=lambda seed: seed))
    actors = SimpleNamespace(
        engines=[engine],
        policy=[],
        critic=[],
        reference=[],
        own_reference=[],
        reward=[],
        restart_engine=lambda e: engine,
    )
    loop = _loop(_Task(), actors, Sync())
    loop.trained = 1
    main = threading.Thread(target=loop.sync_engines, args=({},))
    main.start()
    assert pushing.wait(timeout=10)  # the push is under way
    loop.fleet._replace_dead_engine(0, step=2)
    main.join()
    assert "prepare DURING A PUSH" not in events
    assert events == ["push v1 start", "push v1 end", "prepare", "push v1 start", "push v1 end"]
    assert loop.engine_restarts == 1


def test_an_engine_lost_while_the_groups_form_again_is_replaced_in_turn_and_a_dead_one_before_a_push_first(monkeypatch):
    """A replacement killed before it was ever used (as the weight groups form again around it) is
    replaced in its turn, charged to the budget -- it used to fail the step and restart every role;
    and a push that finds an engine dead replaces it first (pushed to, it would break the broadcast
    and strand the others in it). Each dead engine costs one restart, no more."""
    from rlhf_orch.orchestration import fleet as engine_recovery
    from rlhf_orch.orchestration import fleet as loop_module
    from rlhf_orch.sync.base import WeightSyncError

    started: list[int] = []
    failures = iter([WeightSyncError("an engine or trainer process died while forming the weight-sync groups")])

    class Sync:
        def prepare(self, *args):
            error = next(failures, None)
            if error is not None:
                raise error

        def push(self, version): ...
        def verify(self, version): ...

    engine = SimpleNamespace(reseed=SimpleNamespace(remote=lambda seed: seed))
    actors = SimpleNamespace(
        engines=[engine, engine],
        policy=[],
        critic=[],
        reference=[],
        own_reference=[],
        reward=[],
        restart_engine=lambda e: started.append(e) or engine,
    )
    loop = _loop(_Task(), actors, Sync())
    answers = iter([([0], [])])  # the replacement of engine 0 is found dead once
    monkeypatch.setattr(engine_recovery, "dead_or_stuck", lambda engines, timeout_s: next(answers, ([], [])))
    monkeypatch.setattr(loop_module, "dead_actors", lambda engines, timeout_s: [])
    loop.fleet._replace_dead_engine(0, step=2)
    assert started == [0, 0] and loop.engine_restarts == 2
    monkeypatch.setattr(loop_module, "dead_actors", lambda engines, timeout_s: [1] if not started[2:] else [])
    loop.trained = 1
    loop.sync_engines({})  # engine 1 died since its last call: replaced before the push, not after a broken one
    assert started == [0, 0, 1] and loop.engine_restarts == 3 and loop.version == 1


def test_engines_stuck_in_a_broadcast_a_dead_one_broke_are_replaced_with_it_at_no_charge(monkeypatch):
    """A push breaks: engine 1 is dead, engine 0 alive but stuck in the broken broadcast. Both are
    replaced; the budget is charged one restart (the death), not two. A hung broadcast with no
    engine dead charges the stuck ones."""
    from rlhf_orch.orchestration import fleet as loop_module
    from rlhf_orch.sync.base import WeightSyncError

    started: list[int] = []
    pushes = iter([WeightSyncError("weight broadcast from policy rank 0 failed (an engine probably died)")])

    class Sync:
        def prepare(self, *args): ...
        def verify(self, version): ...

        def push(self, version):
            error = next(pushes, None)
            if error is not None:
                raise error

    engine = SimpleNamespace(reseed=SimpleNamespace(remote=lambda seed: seed))
    actors = SimpleNamespace(
        engines=[engine, engine],
        policy=[],
        critic=[],
        reference=[],
        own_reference=[],
        reward=[],
        restart_engine=lambda e: started.append(e) or engine,
    )
    loop = _loop(_Task(), actors, Sync())
    monkeypatch.setattr(loop_module, "dead_actors", lambda engines, timeout_s: [])
    monkeypatch.setattr(loop_module, "dead_or_stuck", lambda engines, timeout_s: ([1], [0]))
    loop.trained = 1
    loop.sync_engines({})
    assert sorted(started) == [0, 1] and loop.engine_restarts == 1 and loop.version == 1
    loop.fleet._replace_after_sync([], [0, 1], 1)  # nothing dead: a hung broadcast, both charged
    assert loop.engine_restarts == 3


def test_a_push_broken_by_a_dead_policy_rank_restarts_every_role_and_charges_no_engine(monkeypatch):
    """The sender died: the engines are stuck in the broadcast it broke. Replacing them would fail
    again against the dead rank, round after round, until the engine budget ended the run; a lost
    trainer is a lost process instead (ActorDiedError: every role restarts from the checkpoint),
    with no engine replaced or charged -- the first time the push fails, and again if it fails
    while the groups form around replacements."""
    from rlhf_orch.orchestration import fleet as engine_recovery
    from rlhf_orch.orchestration import fleet as loop_module
    from rlhf_orch.orchestration.errors import ActorDiedError, EngineDiedError
    from rlhf_orch.sync.base import WeightSyncError

    class Sync:
        def prepare(self, *args):
            raise WeightSyncError("an engine or trainer process died while forming the weight-sync groups")

        def verify(self, version): ...

        def push(self, version):
            raise WeightSyncError("weight broadcast from policy rank 0 failed")

    started: list[int] = []
    engine = SimpleNamespace(reseed=SimpleNamespace(remote=lambda seed: seed))
    actors = SimpleNamespace(
        engines=[engine, engine],
        policy=["rank 0"],
        critic=[],
        reference=[],
        own_reference=[],
        reward=[],
        restart_engine=lambda e: started.append(e) or engine,
    )
    loop = _loop(_Task(), actors, Sync())
    monkeypatch.setattr(loop_module, "dead_actors", lambda actors, timeout_s: [])  # (no engine dead before the push)
    monkeypatch.setattr(engine_recovery, "dead_actors", lambda actors, timeout_s: [0] if actors == ["rank 0"] else [])
    monkeypatch.setattr(loop_module, "dead_or_stuck", lambda engines, timeout_s: ([], [0, 1]))
    monkeypatch.setattr(engine_recovery, "dead_or_stuck", lambda engines, timeout_s: ([], [0, 1]))
    loop.trained = 1
    with pytest.raises(ActorDiedError, match="policy rank 0 died pushing weight version 1") as raised:
        loop.sync_engines({})
    assert not isinstance(raised.value, EngineDiedError) and started == [] and loop.engine_restarts == 0
    with pytest.raises(ActorDiedError, match="policy rank 0 died"):
        loop.fleet._wire_replacements([0], 1, 1)
    assert started == [0] and loop.engine_restarts == 0  # (the replacement asked for; no round charged)


@pytest.mark.parametrize("pipeline", ["async", "sync"])
def test_a_hand_over_that_finds_an_engine_dead_replaces_it_draws_its_share_again_and_hands_over(pipeline):
    """Under async the hand-over's failure on a dead engine replaces it (charged to the budget),
    draws the share it held again on the replacement and hands the rollout over; a rollout thread
    that replaced an engine meanwhile makes the hand-over look again instead. Under sync the
    failure stands (a lost process: the run restarts from its checkpoint)."""
    from rlhf_orch.orchestration.fleet import EngineFleet
    from rlhf_orch.orchestration.errors import ActorDiedError
    from rlhf_orch.orchestration.pipeline import AsyncPipeline
    from rlhf_orch.transfer.base import EngineShare

    old, replacement = ["engine 0", "engine 1"], "engine 1, replaced"
    events = []

    class Transfer:
        def hand_over(self, held, route):
            events.append(("hand over", list(route.engines)))
            if route.engines[1] != replacement:
                raise ActorDiedError("vLLM engine 1 died while reading the held rollout")
            return "delivered"

        def redraw(self, held, route, lost):
            events.append(("redraw", lost))
            held.shares[1] = [EngineShare(route.engines[1], [1])]
            return 2

    class Loop(EngineFleet):
        def route(self, step=None):
            return SimpleNamespace(engines=list(self.actors.engines))

        def _lost_engines(self):
            return [(1, "engine 1")] if self.actors.engines[1] == "engine 1" else []

        def _replace_engine(self, e, step, dead=None):
            events.append(("replace", e, dead))
            self.actors.engines[e] = replacement
            return replacement

    loop = Loop.__new__(Loop)
    loop.actors, loop.transfer, loop._restart_s, loop._redrawn = SimpleNamespace(engines=list(old)), Transfer(), {}, {}
    loop.pipeline = AsyncPipeline(max_staleness=1) if pipeline == "async" else SyncPipeline()
    held = SimpleNamespace(
        step=3,
        shares=[[EngineShare("engine 0", [0])], [EngineShare("engine 1", [1])]],
        request=object(),
        samples=None,
        ready_at=0.0,
    )
    if pipeline == "sync":
        with pytest.raises(ActorDiedError, match="engine 1 died"):
            loop.hand_over(held)
        assert events == [("hand over", old)]
        return
    assert loop.hand_over(held) == "delivered"
    assert events == [
        ("hand over", old),
        ("replace", 1, "engine 1"),
        ("redraw", [1]),
        ("hand over", ["engine 0", replacement]),
    ]
    assert loop._redrawn == {3: 2}
    # A rollout thread replaced engine 0 while the hand-over ran: look again (its share drawn first).
    events.clear()
    held.shares[0] = [EngineShare("engine 0", [0])]

    def replaced_meanwhile(held, route):
        events.append(("hand over", list(route.engines)))
        if route.engines[0] == "engine 0":
            loop.actors.engines[0] = "engine 0, replaced"
            raise ActorDiedError("vLLM engine 0 died while reading the held rollout")
        return "delivered"

    def redraw(held, route, lost):
        events.append(("redraw", lost))
        held.shares[0] = [EngineShare(route.engines[0], [0])]
        return 2

    loop.transfer.hand_over, loop.transfer.redraw = replaced_meanwhile, redraw
    assert loop.hand_over(held) == "delivered"
    assert events == [
        ("hand over", ["engine 0", replacement]),
        ("redraw", [0]),
        ("hand over", ["engine 0, replaced", replacement]),
    ]


def test_no_final_checkpoint_from_an_update_that_one_role_applied_and_another_did_not(tmp_path):
    """The policy's update returned, the critic's failed: the trainers hold no consistent state of
    any step, so the failure writes no final checkpoint (the last checkpoint stands)."""
    task = _Task()
    loop = _loop(task)
    record = _record(tmp_path, task)
    record.step_finished(1, loop)

    def get(refs, what, **kwargs):
        if what == "training the critic":
            raise StepFailedError("RuntimeError while training the critic: CUDA out of memory")
        return list(refs)

    loop._get = get
    with pytest.raises(StepFailedError):
        loop._update(["policy stats"], ["critic stats"])
    assert loop.trained == 0 and loop.updating
    note = record.final_checkpoint(loop, NO_ACTORS)
    assert note.startswith("no final checkpoint: the failure came while the trainers were updating after step 1")
    assert record.store.latest() is None
    # The same failure before the update began: the trainers still hold step 1, which is kept.
    loop.updating = False
    assert record.final_checkpoint(loop, NO_ACTORS) == ""
    assert record.store.latest().step == 1


def test_a_checkpoint_records_the_sampler_after_every_draw_of_the_rollouts_it_carries(tmp_path):
    """one_step_off + dynamic sampling: the rollout in flight draws more prompts while the
    checkpoint settles it; the checkpoint carries that rollout, so its sampler position must
    include those draws (else a resumed run trains on them twice)."""
    task = _Task()
    extra_round = SimpleNamespace(pending=lambda loop: task.sample_prompts(2) and None)  # settling draws 2 more
    loop = _loop(task, pipeline=extra_round)
    task.sample_prompts(4)
    record = _record(tmp_path, task)
    record.checkpoint(1, loop, NO_ACTORS)
    assert load_driver_state(record.store.latest().path / DRIVER_STATE)["data"] == {"consumed": 6}


def test_a_final_checkpoint_of_an_overlapping_run_goes_back_to_before_the_prompts_drawn_ahead(tmp_path):
    """Under one_step_off step 2's prompts are drawn (its rollout started) before step 1 is
    finished; a final checkpoint of step 1 does not carry that rollout, so it records the sampler
    before step 2's draw: the resumed run draws step 2's prompts again, none is skipped."""
    task = _Task()
    loop = _loop(task, pipeline=OneStepOffPipeline())
    record = _record(tmp_path, task)
    assert loop.rollout_request(1).prompts == [0, 1]
    assert loop.rollout_request(2).prompts == [2, 3]  # drawn ahead, while step 1 trains
    loop.trained = 1
    record.step_finished(1, loop)
    record.final_checkpoint(loop, NO_ACTORS)
    state = load_driver_state(record.store.latest().path / DRIVER_STATE)
    assert state["data"] == {"consumed": 2} and state["exact"] is False
    task.load_state_dict(state["data"])
    assert loop.rollout_request(2).prompts == [2, 3]  # the resumed run's step 2: the same prompts


def test_a_restart_counts_the_engine_replacements_of_every_attempt(tmp_path):
    """An attempt replaced an engine at step 3 and then lost a trainer; the next attempt (from the
    initial weights) starts with that replacement counted: fault/engine_restarts and
    fault.max_engine_restarts are run-wide."""
    task = _Task()
    record = _record(tmp_path, task)
    failed = _loop(task)
    failed.restart_log = {3: [7.5]}
    record.attempt_failed(failed)
    assert record.engine_restart_log == {3: [7.5]}
    failed.restart_log[3].append(1.0)  # (a copy is kept, not the failed loop's own log)
    assert record.engine_restart_log == {3: [7.5]}


def test_a_resumed_run_starts_with_its_fault_budgets_whole(tmp_path):
    """The checkpoint a run resumes from says 3 engines were replaced and 2 whole-run restarts made
    (fault.max_engine_restarts=3 and max_trainer_restarts=2 used up): the resumed invocation may
    replace 3 engines and restart twice again; the logged counters stay the run's."""
    from rlhf_orch.orchestration.checkpoint import ResumePoint

    task = _Task()
    cfg = compose_config(["experiment=quick"])
    typed, _ = check(cfg, instantiate(cfg.launcher))
    state = {"step": 4, "metrics": [], "data": {"consumed": 8}, "trainer_restarts": 2, "engine_restarts": 3}
    resume = ResumePoint(
        SimpleNamespace(path=tmp_path / "checkpoints" / "step_00000004", step=4, manifest={}), state, []
    )
    record = RunRecord(tmp_path, typed, OmegaConf.to_container(cfg, resolve=True), _Logger(), task, resume)
    assert record.trainer_restarts == 2 and record.trainer_restarts_used == 0
    engine = SimpleNamespace(reseed=SimpleNamespace(remote=lambda seed: seed))

    class Sync:
        def prepare(self, *args): ...
        def push(self, version): ...
        def verify(self, version): ...

    actors = SimpleNamespace(
        engines=[engine],
        policy=[],
        critic=[],
        reference=[],
        own_reference=[],
        reward=[],
        restart_engine=lambda e: engine,
    )
    loop = _loop(task, actors, Sync())
    loop.restart_log = {0: [0.0, 0.0, 0.0]}  # (what resume_loop puts back)
    loop.engine_restarts_before = record.engine_restarts_at_start
    loop.fleet._replace_dead_engine(0, step=5)  # 1 of this invocation's 3
    assert loop.engine_restarts == 4 and loop.engine_restarts_used == 1


def test_the_same_failure_twice_is_one_signature_whatever_its_numbers():
    a = RuntimeError("the policy trainer rank 0 died while training the policy (pid 4242, exit code 9, after 12.5s)")
    b = RuntimeError("the policy trainer rank 1 died while training the policy (pid 977, exit code 9, after 3.25s)")
    c = RuntimeError("the critic trainer rank 0 died while training the critic (pid 4242, exit code 9, after 12.5s)")
    assert failure_signature(a) == failure_signature(b)
    assert failure_signature(a) != failure_signature(c)
    assert failure_signature(a) != failure_signature(TimeoutError(str(a)))


def test_a_checkpoint_holding_a_rollout_is_not_resumed_under_another_pipeline_transfer_or_env_reward(tmp_path):
    from rlhf_orch.checkpoint_dirs import CheckpointStore

    from rlhf_orch.transfer.base import HeldRollout
    from rlhf_orch.transfer.rollout_meta import RolloutMeta

    config = {
        "pipeline": {"_target_": "OneStepOffPipeline"},
        "transfer": {"_target_": "PackedTransfer"},
        "resume": None,
    }
    store = CheckpointStore(tmp_path / "checkpoints", 2)
    one_behind = HeldRollout(
        meta=RolloutMeta([0], [3], [1], [1.0], weight_versions=[1]),
        held=[[]],
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=3,
        step=3,
    )  # step 3's, drawn by v1
    for step, pending in ((2, one_behind), (4, None)):
        tmp = store.begin(step)
        torch.save(
            {"step": step, "config": config, "metrics": [], "data": {}, "pending_rollout": pending}, tmp / DRIVER_STATE
        )
        store.commit(tmp, step, {"run_dir": str(tmp_path), "experiment_name": "quick"})
    with_rollout, without = (str(c.path) for c in store.complete())
    sync = {**config, "pipeline": {"_target_": "SyncPipeline"}}
    padded = {**config, "transfer": {"_target_": "PaddedTransfer"}}
    with pytest.raises(
        ResumeError, match=r"carries the rollouts generated ahead.*pipeline._target_.*OneStepOffPipeline"
    ):
        load_resume(with_rollout, tmp_path, None, sync, num_steps=10)
    with pytest.raises(ResumeError, match=r"transfer._target_"):
        load_resume(with_rollout, tmp_path, None, padded, num_steps=10)
    with pytest.raises(
        ResumeError, match=r"env.reward=None; resume with the same env"
    ):  # (per-turn rewards: per token)
        load_resume(with_rollout, tmp_path, None, {**config, "env": {"reward": "per_turn"}}, num_steps=10)
    assert load_resume(without, tmp_path, None, sync, num_steps=10).changed == ["pipeline._target_"]
    # The async pipeline takes a one-step-off rollout (as its first ready one): allowed.
    later = {**config, "pipeline": {"_target_": "AsyncPipeline", "max_staleness": 1}}
    assert "pipeline._target_" in load_resume(with_rollout, tmp_path, None, later, num_steps=10).changed
    with pytest.raises(
        ResumeError, match="pipeline._target_"
    ):  # (max_staleness 0 could not train a rollout one version old)
        load_resume(
            with_rollout,
            tmp_path,
            None,
            {**config, "pipeline": {"_target_": "AsyncPipeline", "max_staleness": 0}},
            num_steps=10,
        )


def test_carried_rollouts_above_a_lowered_max_staleness_are_drawn_again_not_trained(tmp_path):
    """An async checkpoint after step 4 carries the rollouts of steps 5-7, drawn by versions 3, 2
    and 4 (staleness at their step: 1, 3, 2). Resumed with max_staleness=2 (from 3), step 6's
    rollout would train 3 versions behind: it and step 7's are dropped and the sampler goes back
    to before step 6's prompts (drawn again within the bound); step 5's is kept. Resumed with the
    same bound nothing changes; an older checkpoint without the sampler positions is refused."""
    from rlhf_orch.checkpoint_dirs import CheckpointStore
    from rlhf_orch.transfer.base import HeldRollout
    from rlhf_orch.transfer.rollout_meta import RolloutMeta

    def held(step: int, version: int) -> HeldRollout:
        meta = RolloutMeta(
            indices=[0, 1],
            seq_lens=[3, 3],
            response_lens=[1, 1],
            rewards=[0.0, 1.0],
            weight_versions=[version, version + 1],
        )
        return HeldRollout(meta=meta, held=[[]], num_shards=1, micro_batch_size=1, pad_id=0, max_seq_len=3, step=step)

    config = {
        "pipeline": {"_target_": "AsyncPipeline", "max_staleness": 3},
        "transfer": {"_target_": "PackedTransfer"},
        "resume": None,
    }
    store = CheckpointStore(tmp_path / "checkpoints", 2)

    def checkpoint(step: int, **extra) -> str:
        tmp = store.begin(step)
        state = {
            "step": step,
            "config": config,
            "metrics": [],
            "data": {"consumed": 14},
            "pending_rollout": [held(5, 3), held(6, 2), held(7, 4)],
            **extra,
        }
        torch.save(state, tmp / DRIVER_STATE)
        store.commit(tmp, step, {"run_dir": str(tmp_path), "experiment_name": "quick"})
        return str(store.latest().path)

    path = checkpoint(4, data_before_pending={5: {"consumed": 8}, 6: {"consumed": 10}, 7: {"consumed": 12}})
    same = load_resume(path, tmp_path, None, config, num_steps=10)
    assert [h.step for h in same.state["pending_rollout"]] == [5, 6, 7] and same.notes == []
    lower = {**config, "pipeline": {"_target_": "AsyncPipeline", "max_staleness": 2}}
    resumed = load_resume(path, tmp_path, None, lower, num_steps=10)
    assert [h.step for h in resumed.state["pending_rollout"]] == [5]
    assert resumed.state["data"] == {"consumed": 10}  # step 6's prompts are drawn again
    assert resumed.state["data_before_pending"] == {5: {"consumed": 8}}  # (6's and 7's: recorded again as drawn)
    assert "of steps 6, 7 (up to 3 versions behind) exceed pipeline.max_staleness=2: drawn again" in resumed.notes[0]
    path = checkpoint(5)  # written before the sampler positions were kept
    with pytest.raises(
        ResumeError,
        match=r"step 6 drawn 3 versions behind, more than pipeline.max_staleness=2.*resume with pipeline.max_staleness=3",
    ):
        load_resume(path, tmp_path, None, lower, num_steps=10)


def test_a_restart_loads_only_its_own_checkpoints_or_the_one_it_resumed_from(tmp_path):
    """Under a shared checkpoint.dir a restart goes back to a checkpoint in this run's own
    directory, or to the one the run was resumed from (a sweep job's, a moved run dir's); any other
    is refused (ForeignCheckpointError) rather than trained on."""
    from rlhf_orch.orchestration.checkpoint import load_resume as load
    from rlhf_orch.orchestration.run_record import ForeignCheckpointError

    task = _Task()
    shared = f"checkpoint.dir={tmp_path / 'shared'}"
    theirs = _record(tmp_path / "theirs", task, shared)
    loop = _loop(task)
    loop.trained = loop.version = 1
    theirs.checkpoint(1, loop, NO_ACTORS)
    their_checkpoint = theirs.store.latest().path
    mine = _record(tmp_path / "mine", task, shared)
    mine.checkpoint(1, loop, NO_ACTORS)
    assert mine.restart_point(num_steps=4).info.path == mine.store.latest().path  # its own
    mine.last_checkpoint = their_checkpoint  # (what a shared, unnamespaced directory could hand it)
    with pytest.raises(ForeignCheckpointError, match="neither this run's"):
        mine.restart_point(num_steps=4)
    # Resumed from another run dir's checkpoint: a restart before its first own checkpoint goes back there.
    cfg = compose_config(["experiment=quick", shared])
    typed, _ = check(cfg, instantiate(cfg.launcher))
    config = OmegaConf.to_container(cfg, resolve=True)
    resumed = RunRecord(
        tmp_path / "job", typed, config, _Logger(), task, load(str(their_checkpoint), tmp_path, None, config, 4)
    )
    assert resumed.restart_point(num_steps=4).info.path == their_checkpoint


def test_the_last_finished_step_tells_two_failures_between_steps_apart(tmp_path):
    """The crash-loop check keys a failure on the last finished step: failures outside any step
    (a checkpoint, a callback) after steps 4 and 8 are two failures, not one repeated."""
    task = _Task()
    record, loop = _record(tmp_path, task), _loop(task)
    assert record.last_finished_step() == 0
    record.step_finished(4, loop)
    assert record.last_finished_step() == 4
    record.step_finished(8, loop)
    assert record.last_finished_step() == 8
