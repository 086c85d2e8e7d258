"""Prompt sources with rule-based rewards."""

from rlhf_orch.data.digit_task import DigitReverseTask, Prompt, reward_fn, score_response

__all__ = ["DigitReverseTask", "Prompt", "reward_fn", "score_response"]
