"""Every estimator gives the same update on two data-parallel policy ranks as on one.

Real DeepSpeed (ZeRO-2, gloo) policy ranks in Ray actors: a one-rank group trains on the whole
rollout, a two-rank group on its two halves, from the same checkpoint, with the same per-sample
values computed once on the driver (as the loop does). Batch-wide quantities -- PPO's advantage
whitening, REINFORCE++'s normalisation, every loss aggregation's denominator -- must be the
global batch's, or the two-rank update differs. Compared: the policy's logprobs on fixed
sequences after the update (tolerance 2e-3 nats; the update itself moves them by > 2e-2). Adam's
first step is lr x sign(grad), so a coordinate whose gradient is ~0 may flip sign between the two
runs: that is the floor of the tolerance.
"""

from __future__ import annotations

import random

import pytest
import ray
import torch
from hydra.utils import instantiate

from rlhf_orch.trainer.workers import PolicyWorker, TrainerSpec
from rlhf_orch.transfer.batch import Sample
from rlhf_orch.transfer.padded import PaddedTransfer
from tests.conftest import compose_config

pytestmark = pytest.mark.integration

ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
SAMPLES_PER_PROMPT = 4
MICRO_BATCH = 4
PROBE = [[1, 30, 37, 34, 32, 29, 32, 34, 37, 2], [1, 30, 35, 36, 31, 29, 31, 36], [1, 30, 33, 38, 29, 38]]
ALGORITHMS = ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo"]


def _rollout(n: int = 16) -> list[Sample]:
    rng = random.Random(11)
    samples = []
    for i in range(n):
        p, r = rng.randint(3, 7), rng.choice([1, 2, 4, 6])
        prompt = [1] + [rng.randint(29, 38) for _ in range(p - 1)]
        samples.append(Sample(prompt, [rng.randint(29, 38) for _ in range(r)], round(rng.random(), 2), index=i))
    samples[4].reward = samples[5].reward = samples[6].reward = samples[7].reward = 0.5  # a group of equal rewards
    return samples


def _group(model_path: str, ranks: int) -> list:
    spec = TrainerSpec(
        model_path=model_path, dtype="float32", zero_stage=2, micro_batch_size=MICRO_BATCH, train_batch_size=16,
        data_parallel_size=ranks, pad_id=0, temperature=1.0, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
        clip_eps=0.2, ppo_epochs=1, seed=0,
    )
    workers = [ray.remote(PolicyWorker).options(num_cpus=1, runtime_env=ENV).remote(spec, r, ranks) for r in range(ranks)]
    host, port = ray.get(workers[0].rendezvous_address.remote())
    ray.get([w.init_distributed.remote(host, port) for w in workers])
    return workers


@pytest.fixture(scope="module")
def groups(tiny_model_path):
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, runtime_env=ENV)
    yield {1: _group(tiny_model_path, 1), 2: _group(tiny_model_path, 2)}
    ray.shutdown()


def _update(workers: list, algo, samples: list[Sample]) -> list[list[float]]:
    """Rebuild from the checkpoint, stage this rank's shard, make experience, train; probe logprobs."""
    ray.get([w.build.remote() for w in workers])
    shards = PaddedTransfer().layout(samples, len(workers), MICRO_BATCH, 0)
    scores = torch.tensor([s.reward for s in samples])
    group_ids = torch.tensor([s.index for s in samples]) // SAMPLES_PER_PROMPT
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    values, _ = algo.sample_values(scores, group_ids, lengths, 8)
    by_index = dict(zip([s.index for s in samples], values.tolist()))
    calls = []
    for rank, (w, shard) in enumerate(zip(workers, shards)):
        w.stage.remote(rank, shard)
        # A fixed reference (logprob -2 at every position) and zero critic values: the same on both sides.
        ref = [torch.full(mb.action_mask.shape, -2.0) for mb in shard] if algo.needs_reference else None
        critic = [torch.zeros(mb.action_mask.shape) for mb in shard] if algo.needs_critic else None
        calls.append(w.make_experience.remote(rank, ref, critic, algo, by_index))
    ray.get(calls)
    ray.get([w.train.remote(rank, algo, 8) for rank, w in enumerate(workers)])
    return ray.get(workers[0].logprobs_of.remote(PROBE))


def _max_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_two_ranks_update_like_one(groups, name):
    algo = instantiate(compose_config([f"algo={name}", "algo.samples_per_prompt=4"]).algo)
    samples = _rollout()
    ray.get(groups[1][0].build.remote())
    before = ray.get(groups[1][0].logprobs_of.remote(PROBE))
    one = _update(groups[1], algo, samples)
    two = _update(groups[2], algo, samples)
    moved = _max_diff(one, before)
    assert moved > 2e-2, f"{name}: the update barely moved the policy ({moved:.2e})"
    assert _max_diff(one, two) < 2e-3, f"{name}: one rank vs two ranks differ by {_max_diff(one, two):.2e} (moved {moved:.2e})"
