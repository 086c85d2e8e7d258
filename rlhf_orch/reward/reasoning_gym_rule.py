"""reasoning-gym's own verifiers as the reward (`reward=reasoning_gym`, with `data=reasoning_gym`).

The label is the dataset entry (question, answer, metadata); the response's answer is what
reasoning-gym's `extract_answer` finds in its last `<answer>...</answer>` (None without one), and the
score is the entry's dataset's `score_answer(answer, entry)`: exactly how reasoning-gym's own
evaluation and the peers training on it (veRL's and TRL's reasoning-gym recipes) score it. Partial
credit is the dataset's (basic_arithmetic gives len(answer)/len(response) when the right answer is
inside a longer one); `reward.partial_credit=false` keeps only full scores (1.0) and makes every
partial one 0, so a policy cannot farm the partial credit of malformed answers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from rlhf_orch.data.base import Prompt
from rlhf_orch.reward.base import Response, RewardError, RewardFunction


@lru_cache(maxsize=None)
def _scorer(dataset: str) -> Callable[[Any, dict], float]:
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(dataset)


class ReasoningGymRule(RewardFunction):
    name = "reasoning_gym"

    def __init__(self, partial_credit: bool = True):
        if not isinstance(partial_credit, bool):
            raise ValueError(f"partial_credit must be true or false, got {partial_credit!r}")
        self.partial_credit = partial_credit

    def score(self, prompt: Prompt, response: Response) -> float:
        from reasoning_gym.utils import extract_answer

        entry = prompt.label
        if not isinstance(entry, dict) or "answer" not in entry or "metadata" not in entry:
            raise ValueError(
                f"reward=reasoning_gym needs a reasoning-gym entry as the label (data=reasoning_gym), got {type(entry).__name__}"
            )
        dataset = entry["metadata"].get("source_dataset") or prompt.source
        score = float(_scorer(dataset)(extract_answer(response.text), entry))
        return score if self.partial_credit or score >= 1.0 else 0.0

    def check(self) -> None:
        try:
            import reasoning_gym  # noqa: F401
        except ImportError:
            raise RewardError("reward=reasoning_gym needs the reasoning-gym package; run: make setup") from None
