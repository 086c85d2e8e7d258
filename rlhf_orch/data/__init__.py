"""Prompt sources: the embedded digit task, and datasets from files or the hub (`rlhf_orch.data.files`,
which reads through `rlhf_orch.data.file_sources`)."""

from rlhf_orch.data.base import Prompt, PromptSource
from rlhf_orch.data.digit_task import DigitReverseTask, reward_fn, score_response

__all__ = ["DigitReverseTask", "Prompt", "PromptSource", "reward_fn", "score_response"]
