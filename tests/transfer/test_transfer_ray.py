"""Every strategy's data path on real Ray actors (model-free engines and trainer sinks).

Each rank must end up holding exactly what the strategy's pure `layout` says, the driver must
receive only metadata (lengths and rewards, in index order), and engine -> trainer objects must
be released once staged.
"""

from __future__ import annotations

import pytest
import ray

from rlhf_orch.transfer.base import RolloutRequest, Route
from rlhf_orch.transfer.micro_batched import MicroBatchedTransfer
from rlhf_orch.transfer.packed import PackedTransfer
from rlhf_orch.transfer.padded import PaddedTransfer
from rlhf_orch.transfer.synthetic import (
    LengthModel,
    SyntheticEngine,
    TrainerSink,
    plain_get,
    synthetic_prompts,
    zero_reward,
)

pytestmark = pytest.mark.integration
PROMPTS, SPP, SHARDS, MBS, ENGINES = 12, 4, 2, 5, 3  # 48 sequences; 5 does not divide 24 nor 4


@pytest.fixture(scope="module")
def cluster():
    # address="local": a new Ray even while another worker's test runs a cluster this one would join
    ray.init(address="local", num_cpus=2, num_gpus=SHARDS, object_store_memory=200 * 2**20, include_dashboard=False)
    engines = [
        ray.remote(SyntheticEngine).remote(LengthModel(mean=30, max_len=90), vocab_size=100, seed=e * 0 + 11)
        for e in range(ENGINES)
    ]
    sinks = [ray.remote(num_gpus=1)(TrainerSink).remote(pad_id=0) for _ in range(SHARDS)]
    ray.get([a.ping.remote() for a in (*engines, *sinks)])
    yield engines, sinks
    ray.shutdown()


def _request(prompt_ids):
    return RolloutRequest(
        prompts=[None] * PROMPTS,
        prompt_ids=prompt_ids,
        samples_per_prompt=SPP,
        max_tokens=90,
        temperature=1.0,
        scorer=zero_reward,
        num_shards=SHARDS,
        micro_batch_size=MBS,
        pad_id=0,
        max_seq_len=64 + 90,
        decode=lambda ids: [""] * len(ids),
    )


def _reference_samples(prompt_ids):
    # The same rollout produced in-process: what every strategy must deliver.
    engine = SyntheticEngine(LengthModel(mean=30, max_len=90), vocab_size=100, seed=11)
    from rlhf_orch.transfer.plan import whole_prompt_requests

    request = _request(prompt_ids)
    samples, _ = engine.produce_samples(
        whole_prompt_requests(range(PROMPTS), SPP), request.job(range(PROMPTS), zero_reward)
    )
    return samples


@pytest.mark.parametrize(
    "transfer",
    [PaddedTransfer(), MicroBatchedTransfer(max_in_flight=2), PackedTransfer(token_budget=200)],
    ids=lambda t: type(t).__name__,
)
def test_each_rank_holds_exactly_the_layout(cluster, transfer):
    engines, sinks = cluster
    prompt_ids = synthetic_prompts(PROMPTS, 64, vocab_size=100)
    route = Route(engines=engines, consumers=[[s] for s in sinks], get=plain_get)
    delivery = transfer.deliver(_request(prompt_ids), route)

    samples = _reference_samples(prompt_ids)
    assert delivery.meta.indices == list(range(PROMPTS * SPP))
    assert delivery.meta.seq_lens == [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    assert delivery.real_tokens == sum(delivery.meta.seq_lens) and delivery.wire_bytes > 0
    assert {"generate", "transfer", "transfer_after_generate"} <= delivery.timings.keys()

    if isinstance(transfer, PackedTransfer):
        # Packed plans micro-batches within one engine's sequences where it can: the expected
        # layout knows which engine holds what (contiguous prompt chunks, as `generate` spreads them).
        from rlhf_orch.transfer.plan import prompt_chunks

        held = [[i for p in chunk for i in range(p * SPP, (p + 1) * SPP)] for chunk in prompt_chunks(PROMPTS, ENGINES)]
        expected = transfer.layout(samples, SHARDS, MBS, 0, held_by_engine=held)
    else:
        expected = transfer.layout(samples, SHARDS, MBS, 0)
    held = ray.get([s.holdings.remote() for s in sinks])
    for shard, sink_holdings in enumerate(held):
        assert sink_holdings[shard]["indices"] == [mb.indices.tolist() for mb in expected[shard]]
        assert sink_holdings[shard]["wire_tokens"] == [int(mb.input_ids.numel()) for mb in expected[shard]]
        got = ray.get(sinks[shard].samples.remote(shard))
        want = [s for mb in expected[shard] for s in mb.to_samples() if s.index >= 0]
        assert [(s.index, s.response_ids.tolist(), sorted(s.fields)) for s in got] == [
            (s.index, s.response_ids.tolist(), sorted(s.fields)) for s in want
        ]
    ray.get([s.clear.remote() for s in sinks])
