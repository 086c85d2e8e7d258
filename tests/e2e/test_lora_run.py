"""A LoRA run end to end on the tiny model (`model.lora.rank=8`, PPO: a critic, and the KL reference
as the policy's own frozen base inside its process): each sync carries the adapter only and the
engine agrees with the trainer; a run resumed from its step-1 checkpoint (the adapters and their
optimizer states, no base weights) is the uninterrupted run bit for bit; the export -- merged and
adapter -- loads in transformers, PEFT and vLLM as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SHARED_RAY, train_in_process
from tests.e2e.test_resume import _comparable, _metrics

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]

RUN = [
    "experiment=quick",
    "model.lora.rank=8",
    "algo.num_steps=3",
    "checkpoint.every_n_steps=1",
    "checkpoint.keep_last=3",
    *SHARED_RAY,
]
FLOAT32_AGREEMENT = 1e-4  # nats


HOSTED: list[bool] = []  # per step: was every reference rank inside its policy rank's process


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from rlhf_orch.orchestration.actors import HostedReference

    run_dir = tmp_path_factory.mktemp("lora_whole")

    def record(step: int, loop) -> None:
        HOSTED.append(
            bool(loop.actors.reference) and all(isinstance(r, HostedReference) for r in loop.actors.reference)
        )

    summary = train_in_process(RUN, run_dir, callbacks=[record])
    assert summary["status"] == "completed"
    return run_dir


def test_each_sync_carries_the_adapter_only_and_the_engine_agrees_with_the_trainer(lora_run):
    rows = _metrics(lora_run)
    full = (lora_run / "policy_hf" / "model.safetensors").stat().st_size
    adapter = (lora_run / "policy_hf" / "adapter" / "adapter_model.safetensors").stat().st_size
    for r in rows:
        # the adapter's tensors (+ a safetensors header on disk), a fraction of the whole model
        assert adapter - 4096 < r["sync/bytes_per_engine"] <= adapter < full / 4
        assert r["rollout/logprob_diff_max"] < FLOAT32_AGREEMENT  # steps 2-3 drawn with synced adapters
    # The reference ran inside the policy's process -- the policy's base with the adapters off -- and
    # the policy drifted from it: the KL term sees it.
    assert HOSTED == [True, True, True]
    assert abs(rows[-1]["kl"]) > 0
    # The policy's checkpoint holds the adapters, not the base: far smaller than the critic's.
    state = lora_run / "checkpoints" / "step_00000003"
    size = lambda role: sum(f.stat().st_size for f in (state / role / "state").iterdir())  # noqa: E731
    assert size("policy") < size("critic") / 3


def test_a_fresh_run_on_the_kept_actors_is_the_first_run_bit_for_bit(lora_run, tmp_path):
    """launcher.keep_actors: the next run resets the engine (the base reloaded, the zero adapter served
    again) and the trainers; with nothing synced before its first rollout, it must draw from the zero
    adapter exactly as a new engine does."""
    again = tmp_path / "again"
    assert train_in_process(RUN, again)["status"] == "completed"
    assert _comparable(_metrics(again)) == _comparable(_metrics(lora_run))


def test_resumed_from_a_checkpoint_it_is_the_uninterrupted_run_bit_for_bit(lora_run, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(lora_run / "checkpoints" / "step_00000001", cut / "checkpoints" / "step_00000001")
    (cut / "metrics.jsonl").write_text((lora_run / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    summary = train_in_process([*RUN, f"resume={cut}"], cut)
    assert summary["status"] == "completed"
    assert _comparable(_metrics(cut)) == _comparable(_metrics(lora_run))
    from safetensors.torch import load_file

    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        whole, again = load_file(str(lora_run / "policy_hf" / name)), load_file(str(cut / "policy_hf" / name))
        assert whole.keys() == again.keys() and all(whole[k].equal(again[k]) for k in whole)


@pytest.mark.extended
def test_the_export_loads_merged_and_as_an_adapter_in_transformers_peft_and_vllm(lora_run, tiny_model_path):
    script = Path(__file__).with_name("lora_export_check.py")
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            str(lora_run / "policy_hf"),
            tiny_model_path,
            json.dumps([1, 30, 31, 38, 33, 35, 29, 5, 6]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("merged_hf_vs_peft", "merged_hf_vs_merged_vllm", "merged_hf_vs_adapter_vllm"):
        assert result[key] < FLOAT32_AGREEMENT, result
    assert result["merged_vs_base"] > 10 * FLOAT32_AGREEMENT, result  # the export is the trained policy


# The full tier only (~60 s: three CLI runs that own their processes); CI has the in-process resume
# above, and test_resume.py's SIGKILL test for full fine-tuning.
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.own_processes
def test_a_lora_run_killed_with_sigkill_resumes_to_the_uninterrupted_run_bit_for_bit(tmp_path):
    import signal

    from tests.e2e.test_resume import _finish, _wait_for
    from rlhf_orch.checkpoint_dirs import complete_checkpoints

    repo = Path(__file__).resolve().parents[2]
    cli = [*[o for o in RUN if o not in SHARED_RAY], "algo.num_steps=4"]

    def start(run_dir: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "run.py", *cli, f"hydra.run.dir={run_dir}", *extra],
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    rc, out = _finish(start(whole))
    assert rc == 0, out[-3000:]
    proc = start(cut)
    _wait_for(lambda: any(c.step == 1 for c in complete_checkpoints(cut / "checkpoints")), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # driver and Ray at once: nothing cleans up
    proc.wait()
    # The kill landed mid-run: no summary, the last complete checkpoint before the last step.
    assert not (cut / "summary.json").exists() and max(c.step for c in complete_checkpoints(cut / "checkpoints")) < 4
    rc, out = _finish(start(cut, f"resume={cut}"))
    assert rc == 0, out[-3000:]
    assert _comparable(_metrics(cut)) == _comparable(_metrics(whole))


# The full tier only (~40 s): ZeRO-3 over two policy ranks (each holding its hosted reference: the
# frozen base under ZeRO-3 partitioning) under one-step-off overlap, resumed from its step-1
# checkpoint (which carries step 2's rollout): the adapters' partitions and optimizer states restored.
@pytest.mark.extended
def test_zero3_two_ranks_one_step_off_lora_resumes_exactly(tmp_path):
    overrides = [
        *RUN,
        "trainer.zero_stage=3",
        "placement.actor_ranks=2",
        "placement.reference_ranks=2",
        "pipeline=one_step_off",
        "algo.tis_cap=2",
        "launcher.keep_actors=false",
    ]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_in_process(overrides, whole)["status"] == "completed"
    rows = _metrics(whole)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    shutil.copytree(whole / "checkpoints" / "step_00000001", cut / "checkpoints" / "step_00000001")
    (cut / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert train_in_process([*overrides, f"resume={cut}"], cut)["status"] == "completed"
    assert _comparable(_metrics(cut)) == _comparable(_metrics(whole))
