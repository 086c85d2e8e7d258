"""Rewards of the `reward` config group: rules, a user's veRL-style function, and how batches are scored.

Every reward is a picklable `RewardFunction`; `execution.score_batch` runs one over a batch with
per-sample timeouts and error counting, inline or in a pool of Ray tasks.

The names load on first use (PEP 562): the package's `options` (the config's declarations) must not
pull in numpy.
"""

from importlib import import_module

_NAMES = {
    "Response": "rlhf_orch.reward.base",
    "RewardError": "rlhf_orch.reward.base",
    "RewardFunction": "rlhf_orch.reward.base",
    "CustomReward": "rlhf_orch.reward.custom",
    "describe_exception": "rlhf_orch.reward.custom",
    "ScoredBatch": "rlhf_orch.reward.execution",
    "score_batch": "rlhf_orch.reward.execution",
    "CountdownRule": "rlhf_orch.reward.rules",
    "DigitReverseRule": "rlhf_orch.reward.rules",
    "GSM8KRule": "rlhf_orch.reward.rules",
    "MathVerifyRule": "rlhf_orch.reward.rules",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
