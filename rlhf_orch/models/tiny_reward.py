"""The tiny reward model: a sequence-classification head on the tiny policy, regressed onto the task's rule.

`reward=model` with `reward.model_path=null` needs a real reward model on a machine that can download
none. This builds one the way reward models are made -- a `*ForSequenceClassification` checkpoint
(one label) whose backbone starts from the policy -- trained on (prompt, response) pairs labelled by
the digit task's rule: exact answers, answers with digits corrupted, cut short, extended with junk,
with and without EOS (truncated generations end without one). It is a learned approximation of the
rule, so PPO against it is RLHF against a learned reward, with a score that can be checked against
the rule it imitates. Cached by content like the policy (`rlhf_orch.models.cache.build_once`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rlhf_orch.data.digit_task import DigitReverseTask, score_response
from rlhf_orch.models.cache import BUILD_THREADS, build_once
from rlhf_orch.models.warm_start_task import default_warm_start_task

BUILD_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RewardModelRecipe:
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    threads: int = BUILD_THREADS


def _candidate(answer: str, rng: np.random.Generator) -> str:
    """A response to score: the answer, or one of the ways a policy gets it wrong."""
    words = answer.split()
    kind = rng.integers(0, 5)
    if kind == 0:
        return answer
    if kind == 1:  # some digits wrong
        return " ".join(str(int(rng.integers(0, 10))) if rng.random() < 0.5 else w for w in words)
    if kind == 2:  # cut short
        return " ".join(words[: int(rng.integers(0, len(words)))])
    if kind == 3:  # extra items after the answer
        extra = [str(int(rng.integers(0, 10))) if rng.random() < 0.5 else "rev" for _ in range(int(rng.integers(1, 4)))]
        return " ".join(words + extra)
    return " ".join(rng.permutation(words).tolist())  # the right digits in the wrong order


def training_pairs(task: DigitReverseTask, tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[float]]:
    """`n` token sequences (prompt + response [+ EOS]) and the rule's score of each."""
    rng = np.random.default_rng([seed, 7])
    prompts = task.batch(n, 10_000 + seed)  # a batch index far from the ones PPO draws
    sequences, targets = [], []
    for prompt in prompts:
        response = _candidate(prompt.label, rng)
        ids = tokenizer(prompt.text).input_ids + tokenizer(response, add_special_tokens=False).input_ids
        if rng.random() < 0.8:
            ids = ids + [tokenizer.eos_token_id]
        sequences.append(ids)
        targets.append(score_response(prompt.label, response))
    return sequences, targets


def _collate(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def build_tiny_reward_model(out_dir: Path, policy_path: str, task: DigitReverseTask, recipe: RewardModelRecipe) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    started = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        torch.manual_seed(recipe.seed)
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            policy_path, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32
        )
        sequences, targets = training_pairs(task, tokenizer, recipe.steps * recipe.batch_size, recipe.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
        model.train()
        losses = []
        for step in range(recipe.steps):
            rows = slice(step * recipe.batch_size, (step + 1) * recipe.batch_size)
            ids, mask = _collate(sequences[rows], tokenizer.pad_token_id)
            pred = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
            loss = torch.nn.functional.mse_loss(pred, torch.tensor(targets[rows]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        held_seqs, held_targets = training_pairs(task, tokenizer, 256, recipe.seed + 1)
        with torch.no_grad():
            ids, mask = _collate(held_seqs, tokenizer.pad_token_id)
            pred = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        corr = float(np.corrcoef(pred.numpy(), np.array(held_targets))[0, 1])
    finally:
        torch.set_num_threads(previous)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "policy_path": policy_path,
        "recipe": asdict(recipe),
        "final_mse": float(np.mean(losses[-20:])),
        "held_out_correlation_with_rule": round(corr, 4),
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2))


def tiny_reward_model_path(policy_path: str, cache_dir: Path, recipe: RewardModelRecipe = RewardModelRecipe()) -> str:
    """The tiny reward model for the tiny policy at `policy_path`, built on first use."""

    identity = {"format": BUILD_FORMAT_VERSION, "policy": Path(policy_path).name, "recipe": asdict(recipe)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    task = default_warm_start_task()
    return build_once(
        cache_dir, f"tiny-reward-{key}", lambda staging: build_tiny_reward_model(staging, policy_path, task, recipe)
    )
