"""The reward model's Ray actor: scores the sequences of the shards it is handed (forward only)."""

from __future__ import annotations

import torch

from rlhf_orch.trainer import probes
from rlhf_orch.trainer.forward import load_reward_model, sequence_scores
from rlhf_orch.trainer.frozen_models import load_frozen
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.worker import TrainerWorker
from rlhf_orch.transfer.inbox import staged_micro_batches


class RewardModelWorker(TrainerWorker):
    """A reward model rank: scores the sequences of the shards it is handed (forward only)."""

    role = "reward"

    def build(self) -> int:
        self.model = load_frozen(load_reward_model, self.spec, self.device, self.work_done)
        return sum(p.numel() for p in self.model.parameters())

    @ends_a_phase
    @torch.no_grad()
    def score(self, shard: int) -> tuple[list[int], list[float]]:
        """(sample indices, scores) of every sequence of the shard; the shard is then released."""
        indices: list[int] = []
        scores: list[float] = []
        for mb in self.work_done.each(staged_micro_batches(self._staged, shard)):
            values = sequence_scores(self.model, mb).cpu().tolist()
            for i, v in zip(mb.indices.tolist(), values):
                if i >= 0:  # -1: the stand-in of an empty planned micro-batch
                    indices.append(i)
                    scores.append(v)
        self._staged.pop(shard, None)
        return indices, scores

    def scores_of(self, sequences: list[list[int]]) -> list[float]:
        """Scores of whole token sequences, one forward each (tests compare with a plain HF forward)."""
        return probes.scores_of(self.model, sequences, self.spec.pad_id, self.device)
