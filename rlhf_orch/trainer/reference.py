"""The reference's Ray actor: the frozen initial policy in processes of its own, its log-probs for
the KL penalty (the model and the forwards: `frozen_models`)."""

from __future__ import annotations

import torch

from rlhf_orch.trainer.forward import shares_prompts
from rlhf_orch.trainer.frozen_models import frozen_logprobs, reference_model
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.worker import TrainerWorker
from rlhf_orch.transfer.inbox import staged_micro_batches


class ReferenceWorker(TrainerWorker):
    """The frozen initial policy: reference logprobs for the KL penalty."""

    role = "reference"

    def build(self) -> int:
        self.model = reference_model(self.spec, self.device, self.world_size, self.work_done)
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in self.model.parameters())

    @ends_a_phase
    @torch.no_grad()
    def logprobs(self, shard: int) -> list[torch.Tensor]:
        out = frozen_logprobs(
            self.model,
            lambda: staged_micro_batches(self._staged, shard),
            shard,
            self.spec,
            self.world_size,
            shares_prompts(self.spec.share_prompts, self.device),
            self.work_done,
        )
        self._staged.pop(shard, None)
        return out
