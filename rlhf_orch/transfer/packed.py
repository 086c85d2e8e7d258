"""Padding-free on the wire: each micro-batch is one flat token buffer plus `cu_seqlens`."""

from __future__ import annotations

from typing import Sequence

from rlhf_orch.transfer.base import MicroBatch, RolloutTransfer, count_micro_batches
from rlhf_orch.transfer.batch import PackedBatch, Sample


class PackedTransfer(RolloutTransfer):
    def layout(self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int) -> list[list[MicroBatch]]:
        return [
            [PackedBatch.from_samples(mb) for mb in shard]
            for shard in count_micro_batches(samples, num_shards, micro_batch_size)
        ]
