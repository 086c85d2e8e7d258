"""Baseline: every sequence padded to the whole batch's longest, assembled on the driver."""

from __future__ import annotations

from typing import Sequence

from rlhf_orch.transfer.base import MicroBatch, RolloutTransfer, count_micro_batches
from rlhf_orch.transfer.batch import PaddedBatch, Sample


class PaddedTransfer(RolloutTransfer):
    def layout(self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int) -> list[list[MicroBatch]]:
        global_max = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return [
            [PaddedBatch.from_samples(mb, pad_id, pad_to=global_max) for mb in shard]
            for shard in count_micro_batches(samples, num_shards, micro_batch_size)
        ]
