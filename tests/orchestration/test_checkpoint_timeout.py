"""A checkpoint write waits `checkpoint.timeout_s`, not `fault.step_timeout_s`: a slow ZeRO-3 save
is not a dead process. Real Ray actors standing in for trainer ranks (their save just takes time)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from rlhf_orch.checkpoint_dirs import CheckpointStore, complete_checkpoints
from rlhf_orch.orchestration.checkpoint import save_checkpoint
from rlhf_orch.orchestration.loop import ActorTimeoutError
from rlhf_orch.orchestration.waits import ActorWaits

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class SlowSavingRank:
    """A policy rank whose save takes `save_s` seconds and then writes its directory."""

    def __init__(self, save_s: float):
        self.save_s = save_s

    def save_checkpoint(self, directory: str) -> None:
        time.sleep(self.save_s)
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "state.pt").write_bytes(b"x")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(
        address="local", num_cpus=1, include_dashboard=False, log_to_driver=False
    )  # (never another test's cluster)
    yield
    ray.shutdown()


def _loop_get(step_timeout_s: float):
    """The loop's own `_get` (its timeouts and one-line errors) with only the settings it reads."""
    return ActorWaits(step_timeout_s).get


def test_a_save_longer_than_the_step_timeout_completes_within_the_checkpoint_timeout(ray_session, tmp_path):
    actors = SimpleNamespace(policy=[SlowSavingRank.remote(2.0)], critic=[])
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    path = save_checkpoint(store, 1, actors, _loop_get(step_timeout_s=0.5), {"step": 1}, False, {}, timeout_s=60.0)
    assert [c.step for c in complete_checkpoints(tmp_path / "checkpoints")] == [1]
    assert (path / "policy" / "state.pt").exists()

    with pytest.raises(
        ActorTimeoutError,
        match=r"no answer within 0.5s \(checkpoint.timeout_s\) while writing the checkpoint of step 2",
    ):
        save_checkpoint(store, 2, actors, _loop_get(step_timeout_s=600.0), {"step": 2}, False, {}, timeout_s=0.5)
    assert [c.step for c in complete_checkpoints(tmp_path / "checkpoints")] == [1]  # the unfinished one never counts
