"""Liveness by progress, end to end: a trainer phase, a verifier, a generation or an evaluation
that keeps moving for several `fault.step_timeout_s` is waited for; a rank or an engine that stops
moving inside one is found by its progress and every role restarts (docs/reliability.md).
Split from test_failed_run_keeps_its_work.py (its run settings and helpers)."""

from __future__ import annotations

import time

import pytest
import ray

from rlhf_orch.orchestration import warm_actors
from tests.conftest import all_resources_free

from tests.e2e.test_failed_run_keeps_its_work import _metrics, _slow_engine_steps, _train

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]


def _slow_forwards(worker, seconds: float, hang_at: int = 0) -> None:
    """(Inside a trainer rank.) Every forward of a micro-batch (log-probs, with or without gradients)
    takes `seconds` longer: a phase longer than the step timeout that moves micro-batch by
    micro-batch. `hang_at` > 0: that forward never returns (the rank alive, its count standing)."""
    from rlhf_orch.trainer import experience, frozen_models, policy_update

    calls = []

    def slowed(forward):
        def slow(*args, **kwargs):
            calls.append(1)
            time.sleep(3600 if len(calls) == hang_at else seconds)
            return forward(*args, **kwargs)

        return slow

    experience.sequence_logprobs = slowed(experience.sequence_logprobs)  # old log-probs
    frozen_models.sequence_logprobs = slowed(frozen_models.sequence_logprobs)  # the hosted reference's
    policy_update.sequence_logprobs_and_entropy = slowed(policy_update.sequence_logprobs_and_entropy)


# slow (~50 s): a run whose experience and update phases each take several step timeouts.
@pytest.mark.extended
@pytest.mark.slow
def test_a_trainer_phase_longer_than_the_step_timeout_that_moves_is_waited_for(tmp_path, capsys):
    """fault.step_timeout_s=4 and, after step 1, every forward of a policy micro-batch 1 s longer:
    step 2's experience (8 micro-batches of 2 sequences, the hosted reference's 8 before them: 16 s)
    and update (8 s) take two timeouts and more each, the rank's count moving micro-batch by
    micro-batch -- waited for by its progress, no restart. (Before, a trainer phase had one
    wall-clock window: every role restarted.)"""
    slowed = []

    def slow_the_policy(step: int, loop) -> None:
        if step == 1 and not slowed:
            slowed.append(step)
            ray.get(loop.actors.policy[0].__ray_call__.remote(_slow_forwards, 1.0))

    run_dir = tmp_path / "run"
    try:  # (micro_batched: micro-batches of micro_batch_size sequences, however short)
        summary = _train(
            run_dir,
            "algo.num_steps=2",
            "transfer=micro_batched",
            "algo.micro_batch_size=2",
            "fault.step_timeout_s=4",
            "sync.timeout_s=4",
            "reward.timeout_s=2",
            callbacks=[slow_the_policy],
        )
    finally:
        warm_actors.release()  # the slowed rank is never kept for another test's run
    assert slowed == [1] and summary["status"] == "completed" and summary["trainer_restarts"] == 0
    rows = _metrics(run_dir)
    assert [r["fault/trainer_restarts"] for r in rows] == [0, 0]
    assert rows[1]["time/experience"] > 16 and rows[1]["time/train"] > 8  # two timeouts and more, each
    assert "restarting" not in capsys.readouterr().out
    assert all_resources_free()


# slow (~60 s): the run, a rank hung in step 3's experience, a restart.
@pytest.mark.extended
@pytest.mark.slow
def test_a_trainer_rank_hung_inside_a_phase_is_found_by_its_progress_and_restarted(tmp_path, capsys):
    """After step 2 the policy rank's second forward of a micro-batch never returns: step 3's
    experience starts (the hosted reference's first forward), then the rank hangs mid-phase, alive,
    its `progress` answering with a count that stands -- and the critic, done, stands too. The wait
    gives up once a look finds no rank of the phase moved (within two timeouts), names them and the
    key, and every role restarts from step 2's checkpoint; the run completes."""
    hung = []

    def hang_the_policy(step: int, loop) -> None:
        if step == 2 and not hung:
            hung.append(loop.actors.policy[0])
            ray.get(loop.actors.policy[0].__ray_call__.remote(_slow_forwards, 0.0, 2))

    run_dir = tmp_path / "run"
    try:
        summary = _train(
            run_dir,
            "checkpoint.every_n_steps=2",
            "fault.step_timeout_s=4",
            "sync.timeout_s=4",
            "reward.timeout_s=2",
            callbacks=[hang_the_policy],
        )
    finally:
        warm_actors.release()
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 1 and len(hung) == 1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["fault/trainer_restarts"] for r in rows] == [0, 0, 1, 1]
    out = capsys.readouterr().out
    assert (
        "step 3: ActorTimeoutError: no answer within 4s (fault.step_timeout_s) while computing experience: "
        "policy rank 0, critic rank 0 made no progress within 4s (fault.step_timeout_s) or did not answer"
    ) in out
    assert "restarting every role from the checkpoint of step 2" in out
    with pytest.raises(ray.exceptions.RayActorError):  # the hung process did not outlive the restart
        ray.get(hung[0].ping.remote(), timeout=30)
    assert all_resources_free()


SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})  # a slow verifier
    return float(solution_str.split() == ground_truth.split())
"""


# slow (~45 s): a run whose every rollout is scored for three step timeouts.
@pytest.mark.extended
@pytest.mark.slow
def test_scoring_that_keeps_scoring_for_several_step_timeouts_is_never_taken_for_a_stuck_engine(tmp_path, capsys):
    """A verifier taking 0.75 s a sample, 16 samples on the one engine: each rollout's scoring takes
    ~12 s, three fault.step_timeout_s=4 windows, after generation made its last engine step. Every
    scored sample counts as the engine's progress: no restart. (Before, scoring made no count and
    had one window: the engine was taken for a stuck one.)"""
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD.format(seconds=0.75))
    run_dir = tmp_path / "run"
    summary = _train(
        run_dir,
        "algo.num_steps=2",
        "reward=custom",
        f"reward.path={reward}",
        "reward.timeout_s=2",
        "fault.step_timeout_s=4",
        "sync.timeout_s=4",
    )
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0
    rows = _metrics(run_dir)
    assert [r["fault/trainer_restarts"] for r in rows] == [0, 0] and all(r["reward/timeouts"] == 0 for r in rows)
    assert all(r["time/generate"] > 12 for r in rows)  # generation and the scoring after it: three timeouts and more
    assert "restarting" not in capsys.readouterr().out
    assert all_resources_free()


def _stuck_engine_steps(engine) -> None:
    """(Inside an engine actor.) vLLM's next engine step never returns; the actor stays alive."""
    engine.llm.llm_engine.step = lambda: time.sleep(3600)


# slow (~60 s): a generation three step timeouts long, a stuck engine found, a restart.
@pytest.mark.extended
@pytest.mark.slow
def test_a_generation_making_tokens_is_never_timed_out_and_a_stuck_engine_is_found_by_its_progress(tmp_path, capsys):
    """fault.step_timeout_s=6. After step 1 every engine step takes 1 s longer: step 2's generation
    (16 tokens per response: ~17 s, about three timeouts) makes engine steps, so it is waited for
    -- no restart. After step 2 the engine's next vLLM step never returns (the actor alive, its
    `progress` answering, no step made): step 3's generation is found stuck within two timeouts and
    every role restarts from step 2's checkpoint; the run completes."""
    stuck = []

    def slow_then_stuck(step: int, loop) -> None:
        engine = loop.actors.engines[0]
        if step == 1:
            ray.get(engine.__ray_call__.remote(_slow_engine_steps, 1.0))
        elif step == 2 and not stuck:
            stuck.append(time.monotonic())
            ray.get(engine.__ray_call__.remote(_stuck_engine_steps))

    run_dir = tmp_path / "run"
    try:
        summary = _train(
            run_dir,
            "fault.step_timeout_s=6",
            "sync.timeout_s=6",
            "reward.timeout_s=4",
            "checkpoint.every_n_steps=2",
            "algo.min_response_len=16",
            callbacks=[slow_then_stuck],
        )
    finally:
        warm_actors.release()  # the patched engine is never kept for another test's run
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["fault/trainer_restarts"] for r in rows] == [0, 0, 1, 1]
    assert rows[1]["time/generate"] > 12  # two timeouts: waited for, since the engine made steps
    out = capsys.readouterr().out
    assert (
        "step 3: ActorTimeoutError: no answer within 6s (fault.step_timeout_s) while generating: "
        "vLLM engine 0 made no engine step within 6s"
    ) in out
    assert "restarting every role from the checkpoint of step 2" in out
    assert all_resources_free()


def _slow_greedy_steps(engine, seconds: float) -> None:
    """(Inside an engine actor.) Every vLLM engine step of a greedy generation (the evaluation's:
    training samples at temperature 1) takes `seconds` longer."""
    complete, step = engine.rollouts._complete, engine.llm.llm_engine.step
    greedy = []

    def completing(requests, job):
        greedy.append(job.temperature == 0.0)
        try:
            yield from complete(requests, job)
        finally:
            greedy.pop()

    def slow():
        if greedy and greedy[-1]:
            time.sleep(seconds)
        return step()

    engine.rollouts._complete, engine.llm.llm_engine.step = completing, slow


# slow (~40 s): an evaluation several step timeouts long.
@pytest.mark.extended
@pytest.mark.slow
def test_an_evaluation_making_tokens_is_never_timed_out(tmp_path, capsys):
    """fault.step_timeout_s=4 and every engine step of the evaluation 2 s longer: the held-out
    evaluation after step 2 takes several timeouts, making engine steps all along -- waited for
    by its progress like a training rollout, no restart. (Before, one wall-clock window: the
    evaluation was a hung engine and every role restarted, again and again.)"""

    def slow_evaluations(step: int, loop) -> None:
        if step == 1:
            ray.get(loop.actors.engines[0].__ray_call__.remote(_slow_greedy_steps, 2.0))

    run_dir = tmp_path / "run"
    try:
        summary = _train(
            run_dir,
            "fault.step_timeout_s=4",
            "sync.timeout_s=4",
            "reward.timeout_s=2",
            "eval.every_n_steps=2",
            "eval.num_prompts=4",
            callbacks=[slow_evaluations],
        )
    finally:
        warm_actors.release()  # the slowed engine is never kept for another test's run
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[1]["time/eval"] > 6  # 1.5 step timeouts and more (~8 s)
    assert "restarting" not in capsys.readouterr().out
    assert all_resources_free()


# slow (~60 s): two generations several sync timeouts long.
@pytest.mark.extended
@pytest.mark.slow
def test_with_partial_rollout_false_a_push_waits_for_a_generation_longer_than_the_sync_timeout(tmp_path, capsys):
    """pipeline=async, max_staleness=1, partial_rollout=false, sync.timeout_s=6. After step 1 every
    engine step takes 1 s longer: the rollout generated ahead (16 tokens per response: ~17 s) is
    still in flight when the trainers push the next version. The engines finish its requests with
    the weights they started with before taking the update; the driver waits for that by their
    progress, so the push (bounded by sync.timeout_s) never waits behind it: the run completes with
    no restart and no sequence interrupted. (Before, the trainers' push gave up after 6 s.)"""
    slowed = []

    def slow_engine(step: int, loop) -> None:
        if step == 1 and not slowed:
            slowed.append(step)
            ray.get(loop.actors.engines[0].__ray_call__.remote(_slow_engine_steps, 1.0))

    run_dir = tmp_path / "run"
    try:
        summary = _train(
            run_dir,
            "algo.num_steps=3",
            "pipeline=async",
            "pipeline.max_staleness=1",
            "pipeline.partial_rollout=false",
            "algo.decoupled_is_cap=5",
            "fault.step_timeout_s=6",
            "sync.timeout_s=6",
            "reward.timeout_s=4",
            "algo.min_response_len=16",
            callbacks=[slow_engine],
        )
    finally:
        warm_actors.release()  # the slowed engine is never kept for another test's run
    assert slowed == [1]
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout/interrupted"] == 0 for r in rows)
    assert max(r["time/update_wait"] for r in rows[1:]) > 6  # waited longer than sync.timeout_s for the requests
    assert "restarting" not in capsys.readouterr().out
    assert all_resources_free()


# slow (~10 s): one more run beside the module's uninterrupted one.
