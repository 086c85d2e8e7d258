"""The same PPO step on the same rollout gives the same loss and update under every strategy.

Trainer workers run in this process (no Ray) with real DeepSpeed (ZeRO-2, one rank). The three
layouts cut the rollout differently -- 3 count-based padded micro-batches vs token-budget packed
micro-batches of varying size and count -- and the token-weighted accumulation with an explicit
gradient-accumulation boundary makes the optimizer step identical. Tolerance: float32 on CPU,
1e-5 on losses; updated weights equal to 1e-6 except where Adam's first step amplifies ~0 gradients.
"""

from __future__ import annotations

import os
import random
import socket

import pytest
import torch

from rlhf_orch.algo.estimators import PPO
from rlhf_orch.trainer.workers import CriticWorker, PolicyWorker, ReferenceWorker, TrainerSpec
from rlhf_orch.transfer.batch import Sample
from rlhf_orch.transfer.micro_batched import MicroBatchedTransfer
from rlhf_orch.transfer.packed import PackedTransfer
from rlhf_orch.transfer.padded import PaddedTransfer

pytestmark = pytest.mark.integration
PAD = 0
ALGO = PPO(gamma=1.0, lam=0.95, kl_coef=0.05, kl_estimator="k1", whiten_advantages=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed():
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        port = _free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield


def _rollout(n: int = 12) -> list[Sample]:
    rng = random.Random(7)
    samples = []
    for i in range(n):
        p, r = rng.randint(2, 8), rng.choice([0, 1, 4, 9, 15])
        samples.append(Sample([rng.randint(3, 40) for _ in range(p)], [rng.randint(3, 40) for _ in range(r)], rng.random(), index=i))
    return samples


def _spec(path: str, train_batch_size: int) -> TrainerSpec:
    return TrainerSpec(
        model_path=path, dtype="float32", zero_stage=2, micro_batch_size=4, train_batch_size=train_batch_size,
        data_parallel_size=1, pad_id=PAD, temperature=1.0, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
        clip_eps=0.2, ppo_epochs=1, seed=1,
    )


def _ppo_step(transfer, path: str, train_batch_size: int = 12):
    samples = _rollout()
    spec = _spec(path, train_batch_size)
    workers = [PolicyWorker(spec, 0, 1), CriticWorker(spec, 0, 1), ReferenceWorker(spec, 0, 1)]
    for w in workers:
        w.build()
        w.stage(0, transfer.layout(samples, 1, spec.micro_batch_size, PAD)[0])
    policy, critic, reference = workers
    num_micro_batches = len(policy._staged[0])
    ref = reference.logprobs(0)
    values = critic.values(0)
    stats, returns = policy.make_experience(0, ref, values, ALGO, {s.index: s.reward for s in samples})
    p = policy.train(0, ALGO, norm_len=16)
    c = critic.train({0: returns})
    weights = torch.cat([t.detach().flatten() for t in policy.engine.module.parameters()])
    return {"policy": p, "critic": c, "kl": stats["kl"], "weights": weights, "mbs": num_micro_batches, "steps": policy.engine.global_steps}


def test_same_loss_and_update_for_all_strategies(distributed, tiny_model_path):
    runs = {
        "padded": _ppo_step(PaddedTransfer(), tiny_model_path),
        "micro_batched": _ppo_step(MicroBatchedTransfer(), tiny_model_path),
        "packed": _ppo_step(PackedTransfer(token_budget=40), tiny_model_path),
    }
    assert runs["padded"]["mbs"] == 3 and runs["packed"]["mbs"] != 3  # genuinely different cuts
    base = runs["padded"]
    assert base["policy"]["policy_loss"] != 0.0 and base["critic"]["value_loss"] > 0.0
    for name, run in runs.items():
        assert run["steps"] == 1, name  # one optimizer step whatever the micro-batch count
        assert run["kl"] == pytest.approx(base["kl"], abs=1e-6), name
        for key in ("policy_loss", "clipfrac", "approx_kl"):
            assert run["policy"][key] == pytest.approx(base["policy"][key], abs=1e-5), (name, key)
        assert run["critic"]["value_loss"] == pytest.approx(base["critic"]["value_loss"], abs=1e-5), name
        # Adam's first step moves every weight by ~lr * sign(grad): where a gradient is ~0
        # (|g| ~ eps) float noise can flip it, so a handful of weights may differ by up to lr.
        diff = (run["weights"] - base["weights"]).abs()
        assert (diff > 1e-6).float().mean() < 1e-3, name
        assert float(diff.max()) <= 1e-3, name


def test_varying_micro_batch_counts_step_at_planned_boundaries(distributed, tiny_model_path):
    # 12 sequences, train batch 6: two optimizer steps per epoch, over however many packed
    # micro-batches the budget made (grouped contiguously, sizes differing by at most one).
    run = _ppo_step(PackedTransfer(token_budget=24), tiny_model_path, train_batch_size=6)
    assert run["mbs"] > 2
    assert run["steps"] == 2
