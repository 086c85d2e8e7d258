"""What every reward function is: a scalar score for (prompt, response), picklable, label-aware.

Rewards run where the samples are (inside engine actors or in a pool of Ray tasks), so an instance
is shipped by pickle every step: it must hold only plain values, and anything heavy (a user's module,
a parser) is loaded lazily in the process that scores. How a batch is scored under timeouts and
errors is `rlhf_orch.reward.execution`; this module only says what a function is.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

from rlhf_orch.data.base import Prompt


@dataclass(frozen=True)
class Response:
    """One generated response, as the reward sees it."""

    text: str  # decoded response, special tokens skipped
    num_tokens: int
    truncated: bool  # stopped at max_tokens without EOS


class RewardError(RuntimeError):
    """A reward returned something that is not a finite number, or could not be loaded.

    Unlike an exception inside a reward (one sample scores 0 and is counted), this stops the run:
    a function returning NaN or a string is a bug that would silently poison every advantage.
    """


class RewardFunction(abc.ABC):
    """A scalar score for (prompt, response).

    Instances must be picklable (they are shipped to Ray actors each step).
    """

    name: str = "reward"  # instance or class attribute: used in metrics and messages
    # True: every prompt must carry a label (checked before training, not per sample).
    needs_label: ClassVar[bool] = True
    # True: `score_batch` is one call for the whole batch (execution.py times the batch, not samples).
    batched: bool = False
    # A per-sample limit this function asks for, tighter than the run's `reward.timeout_s`;
    # execution.score_batch uses the smaller of the two. None: the run's limit alone.
    timeout_s: Optional[float] = None

    @abc.abstractmethod
    def score(self, prompt: Prompt, response: Response) -> float:
        """The reward of one response. May raise; execution.py turns that into a counted 0."""

    def score_batch(self, prompts: Sequence[Prompt], responses: Sequence[Response]) -> list[float]:
        """Scores of a batch; per-sample by default, overridden by functions that score a batch at once."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.score(p, r) for p, r in zip(prompts, responses)]

    def check(self) -> None:
        """Load whatever the function needs, raising RewardError now rather than at the first step.

        Rules hold everything in their constructor arguments, so there is nothing to load; functions
        backed by user files (CustomReward) override this.
        """

    def describe_error(self, exc: BaseException) -> str:
        """One line for the log about an exception raised while scoring."""
        return repr(exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def as_score(value: Any) -> Optional[float]:
    """`value` as a float when it is a finite real number, else None.

    Accepted: int, float, bool, numpy scalars and 0-d arrays/tensors (`.item()`), which users' reward
    code returns all the time. Strings are refused even when they look like numbers: a function
    returning "1.0" is a bug.
    """
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (numbers.Real, np.bool_)):
        out = float(value)
    else:
        return None
    return out if math.isfinite(out) else None


def check_number(name: str, value: Any, *, minimum: Optional[float] = None) -> float:
    """A constructor argument that must be a finite real number (ValueError naming the argument)."""
    out = as_score(value) if not isinstance(value, bool) else None
    if out is None:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return out
