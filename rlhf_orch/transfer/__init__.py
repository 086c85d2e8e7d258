"""Rollout experience formats and the pure planners that cut them into micro-batches."""

from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, PackedBatch, PaddedBatch, Sample
from rlhf_orch.transfer.micro_batches import plan_token_budget_micro_batches, shard_for_ranks, split_by_count

__all__ = [
    "ENGINE_LOGPROBS",
    "PackedBatch",
    "PaddedBatch",
    "Sample",
    "plan_token_budget_micro_batches",
    "shard_for_ranks",
    "split_by_count",
]
