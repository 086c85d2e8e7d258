"""A model-free engine and trainer for exercising the transfer strategies at any scale.

`SyntheticEngine` is a `RolloutProducer` whose "generation" draws response lengths from a
long-tailed distribution and fills every per-token field a PPO experience carries (engine,
old and reference logprobs, values, advantages, returns). The same (seed, sample index) always
gives the same sequence, so every strategy moves the identical rollout. `TrainerSink` is a
trainer rank without a model: it stages what it is sent and reports what it holds.
Used by `scripts/bench/bench_transfer.py` and the Ray tests of the strategies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from rlhf_orch.reward.base import RewardFunction
from rlhf_orch.reward.scoring import RuleScoring
from rlhf_orch.transfer.engine_side import Completion, RolloutJob, RolloutProducer
from rlhf_orch.transfer.inbox import ExperienceInbox
from rlhf_orch.transfer.plan import CompletionRequest

# Per-token fields of a full PPO experience besides the engine's own logprobs.
PPO_FIELDS = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")


@dataclass(frozen=True)
class LengthModel:
    """Response lengths: lognormal with `sigma`, scaled so the mean after clipping to
    [0, max_len] is about `mean` (a long tail that piles up at max_len, like real rollouts)."""

    mean: float
    max_len: int
    sigma: float = 1.0

    def mu(self) -> float:
        z = np.random.default_rng(0).standard_normal(20000)
        lo, hi = -5.0, math.log(max(self.max_len, 2)) + 5.0
        for _ in range(60):  # bisection on the clipped sample mean
            mid = (lo + hi) / 2
            clipped = np.minimum(np.exp(mid + self.sigma * z), self.max_len).mean()
            lo, hi = (mid, hi) if clipped < self.mean else (lo, mid)
        return (lo + hi) / 2

    def draw(self, rng: np.random.Generator, mu: float) -> int:
        return int(min(self.max_len, round(math.exp(mu + self.sigma * rng.standard_normal()))))


class SyntheticEngine(RolloutProducer):
    def __init__(
        self, lengths: LengthModel, vocab_size: int = 32000, seed: int = 0, fields: Sequence[str] = PPO_FIELDS
    ):
        self.lengths = lengths
        self.vocab_size = vocab_size
        self.seed = seed
        self.fields = tuple(fields)
        self._mu = lengths.mu()
        self.weight_version = 0

    def _complete(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> Iterator[list[Completion]]:
        for request in requests:
            prompt = job.prompt_ids[request.prompt_index]
            completions = []
            for index in request.indices(job.samples_per_prompt):
                rng = np.random.default_rng([self.seed, index])
                n = self.lengths.draw(rng, self._mu)
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
                completions.append(
                    Completion(
                        index=index,
                        prompt_ids=prompt,
                        response_ids=torch.randint(0, self.vocab_size, (n,), generator=gen),
                        logprobs=-torch.rand(n, generator=gen),
                        fields={name: torch.randn(n, generator=gen) for name in self.fields},
                    )
                )
            yield completions

    def _decode(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        return [""] * len(token_ids)

    def ping(self) -> int:
        return 0


class ZeroReward(RewardFunction):
    """The benchmark's reward: rewards are not what is measured."""

    name = "zero"
    needs_label = False

    def score(self, prompt: object, response: object) -> float:
        return 0.0


zero_reward = RuleScoring(
    ZeroReward(), weight=1.0, timeout_s=10.0, pool_size=0
)  # the scorer engines run (inline, like a rule)


class TrainerSink(ExperienceInbox):
    """A trainer rank without a model: holds what it is sent."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id
        self._staged = {}

    def holdings(self) -> dict[int, dict[str, list]]:
        """Per shard: sample indices, real and wire tokens per micro-batch."""
        return {
            shard: {
                "indices": [mb.indices.tolist() for mb in mbs],
                "real_tokens": [int(mb.num_tokens) for mb in mbs],
                "wire_tokens": [int(mb.input_ids.numel()) for mb in mbs],
                "nbytes": [int(mb.nbytes) for mb in mbs],
            }
            for shard, mbs in self._staged.items()
        }

    def samples(self, shard: int) -> list:
        return [s for mb in self._staged[shard] for s in mb.to_samples() if s.index >= 0]

    def clear(self) -> None:
        self.drop_staged()

    def ping(self) -> int:
        return 0


def synthetic_prompts(num_prompts: int, max_prompt_len: int, vocab_size: int = 32000, seed: int = 0) -> list[list[int]]:
    """Prompt token ids with lengths uniform in [max/8, max]."""
    rng = np.random.default_rng([seed, 17])
    lo = max(1, max_prompt_len // 8)
    return [rng.integers(0, vocab_size, int(rng.integers(lo, max_prompt_len + 1))).tolist() for _ in range(num_prompts)]


def plain_get(refs, what: str = "", engine_call: bool = False, timeout_s: float | None = None):
    import ray

    return ray.get(refs, timeout=timeout_s)
