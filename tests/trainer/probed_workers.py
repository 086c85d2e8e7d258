"""The policy's Ray actor with what tests ask of it beyond a run's calls (`rlhf_orch.trainer.probes`):
its log-probs of whole token sequences, and seeded noise added to its weights (a sync must then
change the engine). Pickled by value: Ray's workers need not import `tests`."""

from __future__ import annotations

import sys

import ray

from rlhf_orch.trainer import probes
from rlhf_orch.trainer.policy import PolicyWorker


class ProbedPolicyWorker(PolicyWorker):
    """`PolicyWorker` plus the tests' probes."""

    def logprobs_of(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first, one sequence at a time (no padding at all)."""
        return probes.logprobs_of(self.engine, sequences, self.spec.pad_id, self.device)

    def perturb_weights(self, scale: float, seed: int) -> None:
        """Add seeded noise to every weight (under model.lora: the adapters, the only weights that change)."""
        probes.perturb(self.weight_views.full if self.spec.lora is None else self.weight_views.adapter, scale, seed)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
