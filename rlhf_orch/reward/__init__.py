"""Rewards of the `reward` config group: rules, a user's veRL-style function, and how batches are scored.

Every reward is a picklable `RewardFunction`; `execution.score_batch` runs one over a batch with
per-sample timeouts and error counting, inline or in a pool of Ray tasks.
"""

from rlhf_orch.reward.base import Response, RewardError, RewardFunction
from rlhf_orch.reward.custom import CustomReward, describe_exception
from rlhf_orch.reward.execution import ScoredBatch, score_batch
from rlhf_orch.reward.rules import CountdownRule, DigitReverseRule, GSM8KRule, MathVerifyRule

__all__ = [
    "CountdownRule",
    "CustomReward",
    "DigitReverseRule",
    "GSM8KRule",
    "MathVerifyRule",
    "Response",
    "RewardError",
    "RewardFunction",
    "ScoredBatch",
    "describe_exception",
    "score_batch",
]
