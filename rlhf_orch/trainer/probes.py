"""What tests and benchmarks ask of a trainer rank beyond a run's calls: a model's log-probs or
scores of whole token sequences one at a time, and seeded noise added to weights (a sync must then
change the engine). Plain functions over a model or a weight view; the tests' subclasses of the
workers (tests/trainer/probed_workers.py) and `RewardModelWorker.scores_of` call them."""

from __future__ import annotations

import torch

from rlhf_orch.trainer.forward import sequence_logprobs, sequence_scores
from rlhf_orch.transfer.batch import PaddedBatch, Sample


def single(seq: list[int]) -> Sample:
    """The whole sequence as "response" after a 1-token prompt: every position is scored."""
    return Sample(prompt_ids=seq[:1], response_ids=seq[1:], reward=0.0)


@torch.no_grad()
def logprobs_of(
    model: torch.nn.Module, sequences: list[list[int]], pad_id: int, device: torch.device
) -> list[list[float]]:
    """Logprob of every token after the first, one sequence at a time (no padding at all)."""
    model.eval()
    out = []
    for seq in sequences:
        ids = torch.tensor([seq], device=device)
        mb = PaddedBatch.from_samples([single(seq)], pad_id).to(device)
        lp = sequence_logprobs(model, mb, 1.0)[0]
        out.append(lp[: ids.shape[1] - 1].tolist())
    return out


@torch.no_grad()
def scores_of(
    reward_model: torch.nn.Module, sequences: list[list[int]], pad_id: int, device: torch.device
) -> list[float]:
    """Scores of whole token sequences, one forward each (tests compare with a plain HF forward)."""
    out = []
    for seq in sequences:
        mb = PaddedBatch.from_samples([single(seq)], pad_id).to(device)
        out.append(float(sequence_scores(reward_model, mb)[0]))
    return out


@torch.no_grad()
def perturb(source, scale: float, seed: int) -> None:
    """Add seeded noise to every weight of a weight view (`metas()` / `gathered()`).

    Same seed on every rank: replicated weights (ZeRO-0/1/2) stay identical; under ZeRO-3 the full
    parameters are gathered and rank 0's change is what gets re-partitioned."""
    gen = torch.Generator().manual_seed(seed)
    names = [m.name for m in source.metas()]
    with source.gathered(names, modifier_rank=0) as full:
        for p in full.values():
            p.add_(torch.randn(p.shape, generator=gen).to(p) * scale)
