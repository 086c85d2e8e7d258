"""The real chat model end to end (the `real_model` tier): SmolLM2-135M-Instruct, float32 on CPU.

One short GRPO run of skyrl-gym's text2sql environment, unchanged (SkyRL-SQL's row layout, a small
sqlite database: tests/env/text2sql_rows.py), at temperature 0.7, shows what the tiny models cannot:
multi-turn generation with a 49k BPE vocabulary and ChatML (every context checked against the chat
template: env.tokenization_sanity_check_mode=strict), stop strings ending turns, two training steps
of a 30-layer Llama with grouped KV heads and tied embeddings, the weight sync reloading that layout
into vLLM (step 2's trajectories are drawn with the synced weights: their engine log-probs must
equal the trainer's recomputation at float32 kernel level, which a wrong reload of the tied
embedding or the KV heads breaks by orders of magnitude), the rollout dump read back as the chat
template renders the conversation, and the exported policy loading in transformers and vLLM with
equal log-probs. `experiment=smollm2_arith` (single-turn reasoning-gym) is measured in
docs/real_model.md; its inputs are tested in tests/models/test_real_model_inputs.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hydra.utils import instantiate

from tests.env.text2sql_rows import make_text2sql

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import run_training
from tests.conftest import SHARED_RAY, compose_config
from rlhf_orch.logging.base import read_metrics
from rlhf_orch.view.trajectories import segments

pytestmark = [
    pytest.mark.integration,
    pytest.mark.real_model,
    pytest.mark.extended,
    pytest.mark.usefixtures("shared_ray"),
]

# float32 kernels (vLLM's CPU attention vs transformers' sdpa over 30 layers): measured 4e-5..2e-4.
FLOAT32_AGREEMENT = 2e-3


def _run(overrides: list[str], run_dir: Path) -> list[dict]:
    cfg = compose_config([*overrides, *SHARED_RAY])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    run_training(cfg, typed, plan, launcher, run_dir)
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, smollm2_path):
    run_dir = tmp_path_factory.mktemp("smollm2_run")
    parquet, db_path = make_text2sql(run_dir.parent / "text2sql", max_turns=2)
    # A learning rate that moves every weight visibly in one step (a sync that missed one would show),
    # and an entropy term: with 8 samples every group may score alike (no advantage), the update must
    # still happen.
    rows = _run(
        [
            "model=smollm2_135m",
            "algo=grpo",
            "data=files",
            f"data.train_files=[{parquet}]",
            f"data.val_files=[{parquet}]",
            "data.label_key=reward_spec.ground_truth",
            "data.prompt_max_len=256",
            "data.response_max_len=112",
            "env=skyrl",
            "env.env_class=text2sql",
            f"env.env_config.db_path={db_path}",
            "env.max_turns=3",
            "env.max_tokens_per_turn=32",
            "env.max_observation_tokens=40",
            "env.observation_truncate_side=middle",
            "env.stop=['</sql>','</solution>']",
            "algo.num_steps=2",
            "algo.rollout_batch_size=2",
            "algo.samples_per_prompt=2",
            "algo.temperature=0.7",
            "algo.train_batch_size=4",
            "algo.micro_batch_size=2",
            "algo.actor_lr=1e-4",
            "algo.entropy_coef=0.01",
            "algo.kl_placement=off",
            "algo.kl_coef=0.0",
            "eval.every_n_steps=0",
            "logger.rollouts_per_step=4",
            "checkpoint.at_end=false",  # 1.6 GB of DeepSpeed state (~5 s) no check reads; the export is checked
            "trainer.torch_threads=1",
        ],
        run_dir,
    )  # the suite's other worker has the second core
    return run_dir, rows


def test_two_grpo_steps_of_text2sql_with_the_engine_agreeing_with_the_trainer_after_the_weight_sync(smollm2_run):
    run_dir, rows = smollm2_run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/errors"] == 0 and r["rollout/samples"] == 4 and r["policy/grad_norm"] > 0
        # several turns against the database, none failing, every context the template's
        assert r["env/turns_mean"] >= 1.5 and r["env/step_errors"] == 0 and r["env/step_timeouts"] == 0
        assert r["env/tokenization_mismatches"] == 0
    # the database's answers are longer than env.max_observation_tokens: cut on their content
    assert sum(r["env/observations_truncated"] for r in rows) > 0
    # Step 1 ended with the whole model pushed (135M float32 parameters), so step 2 was drawn by the
    # engine holding the synced weights of step 1's update (on-policy: staleness 0).
    assert rows[1]["weight_version"] == 2 and rows[1]["rollout/staleness_max"] == 0
    diffs = {
        k: rows[1][k]
        for k in ("rollout/logprob_diff_max", "rollout/logprob_diff_mean", "rollout/logprob_diff_over_frac")
    }
    assert diffs["rollout/logprob_diff_max"] < FLOAT32_AGREEMENT, diffs
    assert (
        diffs["rollout/logprob_diff_mean"] < FLOAT32_AGREEMENT / 10 and diffs["rollout/logprob_diff_over_frac"] == 0.0
    ), diffs
    assert rows[0]["sync/bytes_per_engine"] > 500e6


_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)


def test_the_rollout_dump_reads_as_the_chat_template_renders_the_conversation(smollm2_run, smollm2_tokenizer):
    """Each dumped trajectory, split into its messages, is exactly what the chat template renders for
    them: no newline lost after <|im_end|>, no turn generated inside a tool message."""
    run_dir, _ = smollm2_run
    turns_seen = 0
    for step in (1, 2):
        lines = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(lines) == 4
        for line in lines:
            text = line["text"]
            assert text == line["prompt"] + line["response"] and line["data_source"] == "synthetic_spider"
            tail = text[sum(len(m.group(0)) for m in _TURN.finditer(text)) :]
            messages = [{"role": m.group(1), "content": m.group(2)} for m in _TURN.finditer(text)]
            closed = tail == ""
            if not closed:  # the last turn: the model's, still open (cut at its limit) or closed without "\n"
                body = tail.removeprefix("<|im_start|>assistant\n")
                messages.append({"role": "assistant", "content": body.removesuffix("<|im_end|>")})
            rendered = smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
            assert rendered.startswith(text) and rendered[len(text) :] in ("", "\n", "<|im_end|>\n"), (
                text[-200:],
                rendered[-200:],
            )
            assert line["turns"] == sum(m["role"] == "assistant" for m in messages) >= 1
            # The run page's turns (rlhf_orch.view): the same messages, from the dump's per-token
            # texts (which join to the text) and loss mask.
            tokens = line["tokens"]
            assert "".join(tokens["text"]) == text and len(tokens["ids"]) == len(tokens["loss_mask"])
            page_turns = segments(tokens["text"], tokens["loss_mask"])
            assert [s["role"] for s in page_turns] == [m["role"] for m in messages], (page_turns, messages)
            assert sum(s["model"] for s in page_turns) == line["turns"]
            turns_seen += line["turns"]
            for m in messages:
                if m["role"] == "assistant" and "</sql>" in m["content"]:
                    assert m["content"].endswith("</sql>")  # env.stop ended the turn there
    assert turns_seen >= 12  # several turns per trajectory (8 trajectories)


def test_the_exported_policy_loads_in_transformers_and_vllm_with_equal_logprobs(smollm2_run, smollm2_path, tmp_path):
    run_dir, _ = smollm2_run
    export = run_dir / "policy_hf"
    line = json.loads((run_dir / "rollouts" / "step_000002.jsonl").read_text().splitlines()[0])
    script = Path(__file__).with_name("real_model_export_check.py")
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(script), str(export), smollm2_path, line["prompt"], line["response"]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_diff_hf_vs_vllm"] < FLOAT32_AGREEMENT, result
    assert result["max_diff_trained_vs_initial"] > 10 * FLOAT32_AGREEMENT, result  # the export is the trained policy
