"""Rollout experience formats and the pure planners that cut them into micro-batches.

The names load on first use (PEP 562): the package's `options` (the config's declarations) must not
pull in torch.
"""

from importlib import import_module

_NAMES = {
    "ENGINE_LOGPROBS": "rlhf_orch.transfer.batch",
    "PackedBatch": "rlhf_orch.transfer.batch",
    "PaddedBatch": "rlhf_orch.transfer.batch",
    "Sample": "rlhf_orch.transfer.batch",
    "plan_token_budget_micro_batches": "rlhf_orch.transfer.micro_batches",
    "shard_for_ranks": "rlhf_orch.transfer.micro_batches",
    "split_by_count": "rlhf_orch.transfer.micro_batches",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
