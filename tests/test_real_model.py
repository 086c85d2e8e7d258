"""The real chat model end to end (the `real_model` tier): SmolLM2-135M-Instruct, float32 on CPU.

One short GRPO run on reasoning-gym arithmetic (`experiment=smollm2_arith`, two steps) shows what the
tiny models cannot: generation with a 49k BPE vocabulary and ChatML, two training steps of a 30-layer
Llama with grouped KV heads and tied embeddings, the weight sync reloading that layout into vLLM
(step 2's rollout is drawn with the synced weights: its engine log-probs must equal the trainer's
recomputation at float32 kernel level, which a wrong reload of the tied embedding or the KV heads
breaks by orders of magnitude), the rollout dump, and the exported policy loading in transformers and
vLLM with equal log-probs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import run_training
from tests.conftest import SHARED_RAY, compose_config

pytestmark = [pytest.mark.integration, pytest.mark.real_model, pytest.mark.usefixtures("shared_ray")]

# float32 kernels (vLLM's CPU attention vs transformers' sdpa over 30 layers): measured 4e-5..2e-4.
FLOAT32_AGREEMENT = 2e-3


def _run(overrides: list[str], run_dir: Path) -> list[dict]:
    cfg = compose_config([*overrides, *SHARED_RAY])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    run_training(cfg, typed, plan, launcher, run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, smollm2_path):
    run_dir = tmp_path_factory.mktemp("smollm2_run")
    # A learning rate that moves every weight visibly in one step (a sync that missed one would show),
    # and an entropy term: with 8 samples every group may score alike (no advantage), the update must
    # still happen.
    rows = _run(["experiment=smollm2_arith", "algo.num_steps=2", "algo.rollout_batch_size=4", "algo.samples_per_prompt=2",
                 "algo.train_batch_size=8", "algo.micro_batch_size=4", "algo.actor_lr=1e-4", "algo.entropy_coef=0.01",
                 "eval.before_train=false",
                 "eval.every_n_steps=0", "logger.rollouts_per_step=8", "data.response_max_len=24",
                 "trainer.torch_threads=1"], run_dir)  # the suite's other worker has the second core
    return run_dir, rows


def test_two_grpo_steps_with_the_engine_agreeing_with_the_trainer_after_the_weight_sync(smollm2_run):
    run_dir, rows = smollm2_run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/errors"] == 0 and r["rollout/samples"] == 8 and r["response/mean_len"] > 1
        assert r["policy/grad_norm"] > 0
    # Step 1 ended with the whole model pushed (135M float32 parameters), so step 2 was drawn by the
    # engine holding the synced weights of step 1's update (on-policy: staleness 0).
    assert rows[1]["weight_version"] == 2 and rows[1]["rollout/staleness_max"] == 0
    diffs = {k: rows[1][k] for k in ("rollout/logprob_diff_max", "rollout/logprob_diff_mean", "rollout/logprob_diff_over_frac")}
    assert diffs["rollout/logprob_diff_max"] < FLOAT32_AGREEMENT, diffs
    assert diffs["rollout/logprob_diff_mean"] < FLOAT32_AGREEMENT / 10 and diffs["rollout/logprob_diff_over_frac"] == 0.0, diffs
    assert rows[0]["sync/bytes_per_engine"] > 500e6


def test_the_rollout_dump_is_the_chat_templated_conversation(smollm2_run, smollm2_tokenizer):
    run_dir, _ = smollm2_run
    for step in (1, 2):
        lines = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(lines) == 8
        for line in lines:
            assert line["text"] == line["prompt"] + line["response"]
            assert line["prompt"].startswith("<|im_start|>system\nAnswer the question directly.")
            assert line["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") and line["prompt"].count("<|im_start|>assistant") == 3
            assert line["turns"] == 1 and line["data_source"] == "basic_arithmetic" and isinstance(line["reward"], float)
            # What the model wrote, re-rendered by the template as its turn, is the dumped text.
            response = line["response"].removesuffix("<|im_end|>")
            assert smollm2_tokenizer.decode(smollm2_tokenizer(line["prompt"] + response, add_special_tokens=False)["input_ids"]) == line["prompt"] + response
        by_group = {}
        for line in lines:
            by_group.setdefault(line["index"] // 2, []).append(line)
        for group in by_group.values():  # GRPO: the advantages of a group sum to zero
            assert abs(sum(x["advantage"] for x in group)) < 1e-5


def test_the_exported_policy_loads_in_transformers_and_vllm_with_equal_logprobs(smollm2_run, smollm2_path, tmp_path):
    run_dir, _ = smollm2_run
    export = run_dir / "policy_hf"
    line = json.loads((run_dir / "rollouts" / "step_000002.jsonl").read_text().splitlines()[0])
    script = Path(__file__).with_name("real_model_export_check.py")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(script), str(export), smollm2_path, line["prompt"], line["response"]],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_diff_hf_vs_vllm"] < FLOAT32_AGREEMENT, result
    assert result["max_diff_trained_vs_initial"] > 10 * FLOAT32_AGREEMENT, result  # the export is the trained policy
