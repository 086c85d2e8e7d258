"""The interface of the `transfer` group: how a step's rollout reaches the trainer ranks.

`layout` is pure (samples -> per-rank micro-batches); `hand_over` moves each rank's share with
one `ray.put` per rank, so each worker fetches only its own slice.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import ray

from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, Sample, shard_for_ranks, split_by_count

MicroBatch = PaddedBatch | PackedBatch


@dataclass
class HandOver:
    """Object refs, one per data-parallel shard, plus what it cost to make them."""

    shard_refs: list[ray.ObjectRef]
    wire_bytes: int
    padded_tokens: int
    real_tokens: int


class RolloutTransfer(abc.ABC):
    def __init__(self, max_in_flight: int = 4, token_budget: int = 0):
        self.max_in_flight = max_in_flight
        self.token_budget = token_budget

    @abc.abstractmethod
    def layout(
        self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int
    ) -> list[list[MicroBatch]]:
        """Per shard, the micro-batches it trains on (every sample exactly once, order kept)."""

    def hand_over(
        self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int
    ) -> HandOver:
        shards = self.layout(samples, num_shards, micro_batch_size, pad_id)
        wire = sum(mb.nbytes for shard in shards for mb in shard)
        padded = sum(int(mb.input_ids.numel()) for shard in shards for mb in shard)
        real = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return HandOver([ray.put(shard) for shard in shards], wire, padded, real)


def count_micro_batches(samples: Sequence[Sample], num_shards: int, micro_batch_size: int) -> list[list[list[Sample]]]:
    """Contiguous shards of equal size, each cut into micro-batches of `micro_batch_size`."""
    out = []
    for shard in shard_for_ranks(len(samples), num_shards):
        rows = [samples[i] for i in shard]
        out.append([[rows[i] for i in r] for r in split_by_count(len(rows), micro_batch_size)])
    return out
