"""Padding per micro-batch only: each micro-batch padded to its own longest sequence."""

from __future__ import annotations

from typing import Sequence

from rlhf_orch.transfer.base import MicroBatch, RolloutTransfer, count_micro_batches
from rlhf_orch.transfer.batch import PaddedBatch, Sample


class MicroBatchedTransfer(RolloutTransfer):
    def layout(self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int) -> list[list[MicroBatch]]:
        return [
            [PaddedBatch.from_samples(mb, pad_id) for mb in shard]
            for shard in count_micro_batches(samples, num_shards, micro_batch_size)
        ]
