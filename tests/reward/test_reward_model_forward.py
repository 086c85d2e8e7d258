"""The reward model's scores: packed and padded micro-batches give what a plain HF forward gives.

`sequence_scores` runs the backbone on the micro-batch's own layout (packed: one [1, N] row, varlen
attention) and applies the score head at each sequence's last token; HF's
`*ForSequenceClassification` is the reference (one unpadded sequence at a time). Also the tiny
reward model itself: a one-label classifier that ranks right answers above wrong ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_orch.orchestration.evaluation import eval_metrics
from rlhf_orch.data.base import Prompt
from rlhf_orch.trainer.forward import load_reward_model, sequence_scores
from rlhf_orch.models.warm_start_task import default_warm_start_task
from rlhf_orch.models.tiny_reward import _collate, training_pairs
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, Sample

SEQUENCES = [
    [1, 30, 37, 34, 32, 29, 32, 34, 37, 2],
    [1, 30, 35, 36, 29, 36],
    [1, 30, 33, 29],
    [1, 30, 31, 32, 33, 29, 33, 32, 31, 2],
]


@pytest.fixture(scope="module")
def reward_model_path(tiny_model) -> str:
    return tiny_model.reward_model_path()


def _samples() -> list[Sample]:
    return [Sample(prompt_ids=s[:3], response_ids=s[3:], reward=0.0, index=i) for i, s in enumerate(SEQUENCES)]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_scores_equal_a_plain_hugging_face_forward(reward_model_path, layout):
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [float(hf(input_ids=torch.tensor([s])).logits[0, 0]) for s in SEQUENCES]
    ours = load_reward_model(reward_model_path, "float32").eval()
    mb = PackedBatch.from_samples(_samples()) if layout == "packed" else PaddedBatch.from_samples(_samples(), pad_id=0)
    with torch.no_grad():
        got = sequence_scores(ours, mb).tolist()
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == len(got)  # real, distinct scores


def test_tiny_reward_model_is_a_one_label_classifier_that_prefers_right_answers(reward_model_path):
    config = json.loads((Path(reward_model_path) / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    info = json.loads((Path(reward_model_path) / "build_info.json").read_text())
    assert info["held_out_correlation_with_rule"] > 0.3
    tok = AutoTokenizer.from_pretrained(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, dtype=torch.float32).eval()
    # Held-out (prompt, response) pairs of the kinds the task produces (a seed the build never used):
    # exact answers must score above answers the rule scores 0, on average over dozens of each.
    # (Three hand-written probes with an out-of-distribution junk answer used to decide this; on
    # this machine's build they ranked 0.66 vs 0.70 while the held-out means are ~0.67 vs ~0.39.)
    sequences, targets = training_pairs(default_warm_start_task(), tok, 512, seed=99)
    with torch.no_grad():
        ids, mask = _collate(sequences, tok.pad_token_id)
        scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    targets = torch.tensor(targets)
    right, wrong = scores[targets == 1.0], scores[targets == 0.0]
    assert len(right) >= 30 and len(wrong) >= 30
    assert float(right.mean()) > float(wrong.mean()) + 0.1, (float(right.mean()), float(wrong.mean()))


def test_eval_metrics_mean_and_pass_at_k_per_source():
    prompts = [Prompt("a", source="gsm8k"), Prompt("b", source="gsm8k"), Prompt("c", source="math")]
    scores = [1.0, 0.0, 0.0, 0.0, 0.5, 1.0]  # k = 2 per prompt, in prompt order
    m = eval_metrics(prompts, scores, k=2, pass_threshold=1.0)
    assert m == {
        "eval/gsm8k/mean@2": pytest.approx(0.25),
        "eval/gsm8k/pass@2": pytest.approx(0.5),
        "eval/math/mean@2": pytest.approx(0.75),
        "eval/math/pass@2": pytest.approx(1.0),
    }
    with pytest.raises(ValueError):
        eval_metrics(prompts, scores[:5], k=2, pass_threshold=1.0)
