"""The reference's Ray actor: the frozen models in processes of their own -- the initial policy
(the KL penalty's reference) and the teacher (the teacher term's) -- and their log-probs (the
models and the forwards: `frozen_models`)."""

from __future__ import annotations

import torch

from rlhf_orch.trainer.forward import shares_prompts
from rlhf_orch.trainer.frozen_models import frozen_logprobs, frozen_models
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.worker import TrainerWorker
from rlhf_orch.transfer.inbox import staged_micro_batches


class ReferenceWorker(TrainerWorker):
    """The frozen models: the KL penalty's reference log-probs, the teacher term's teacher log-probs."""

    role = "reference"

    def build(self) -> int:
        self.frozen = frozen_models(self.spec, self.device, self.world_size, self.work_done)
        return sum(int(getattr(p, "ds_numel", p.numel())) for m in self.frozen.values() for p in m.parameters())

    @ends_a_phase
    @torch.no_grad()
    def logprobs(self, shard: int) -> dict[str, list[torch.Tensor]]:
        """Per frozen model held ("ref", "teacher"), its log-probs of the shard's action tokens."""
        out = {
            name: frozen_logprobs(
                model,
                lambda: staged_micro_batches(self._staged, shard),
                shard,
                self.spec,
                self.world_size,
                shares_prompts(self.spec.share_prompts, self.device),
                self.work_done,
            )
            for name, model in self.frozen.items()
        }
        self._staged.pop(shard, None)
        return out
