"""What every multi-turn `env` option shares: its limits, how its rewards add up, what it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, EnvGroup, prompt_messages
from rlhf_orch.env.observations import FORMATS, ObservationRenderer
from rlhf_orch.env.trajectory import TrajectoryLimits

REWARDS = ("last", "sum")


@dataclass
class MultiTurnEnv(EnvGroup):
    """Base of `env=custom`, `env=skyrl`, `env=python_tool` (their schema: rlhf_orch.config.schema).

    The trajectory's reward is the environment's (`reward`: the last step's, or the sum of every
    step's) plus `reward_weight` x the `reward` group's score of the final transcript (the decoded
    response: every turn and observation); `reward_weight: 0` leaves the reward group out.
    """

    max_turns: int = 4
    max_tokens_per_turn: int | None = None  # None: the whole response budget
    max_observation_tokens: int = 256
    tool_timeout_s: float = 10.0
    concurrency: int = 16
    reward: str = "last"
    reward_weight: float = 0.0
    observation_format: str = "chat_template"

    multi_turn = True

    def __post_init__(self) -> None:
        if self.reward not in REWARDS:
            raise EnvError(f"env.reward={self.reward!r}: must be one of {', '.join(REWARDS)}")
        if self.observation_format not in FORMATS:
            raise EnvError(f"env.observation_format={self.observation_format!r}: must be one of {', '.join(FORMATS)}")

    def limits(self, response_max_len: int) -> TrajectoryLimits:
        per_turn = self.max_tokens_per_turn or response_max_len
        return TrajectoryLimits(self.max_turns, per_turn, response_max_len, self.max_observation_tokens)

    def check(self, prompt: Prompt, tokenizer: Any) -> None:
        """The observation format renders with this tokenizer; the environment starts for `prompt`."""
        ObservationRenderer(tokenizer, self.observation_format)([{"role": "user", "content": "0"}])
        instance = self.make(prompt)
        instance.init(prompt_messages(prompt))
        getattr(instance, "close", lambda: None)()

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-trajectory means and counts of the runner's counters (`EnvCounts`)."""
        n = max(stats.get("trajectories", 0.0), 1.0)
        return {
            "env/turns_mean": stats.get("turns", 0.0) / n,
            "env/tool_calls_mean": stats.get("tool_calls", 0.0) / n,
            "env/tool_errors": stats.get("tool_errors", 0.0),
            "env/tool_timeouts": stats.get("tool_timeouts", 0.0),
            "env/step_errors": stats.get("env_errors", 0.0),
            "env/step_timeouts": stats.get("env_timeouts", 0.0),
            "env/truncated": stats.get("truncated", 0.0),
            "env/observation_tokens_mean": stats.get("observation_tokens", 0.0) / n,
            "env/observations_truncated": stats.get("observations_truncated", 0.0),
            "time/env": stats.get("env_seconds", 0.0),
        }

    def step_timeout_s(self) -> float:
        """How long one env.step may take before the trajectory ends (counted as env/step_timeouts)."""
        return self.tool_timeout_s

    def option_name(self) -> str:
        return type(self).__name__

    def describe(self) -> list[str]:
        return [
            f"env: {self.option_name()}, up to {self.max_turns} turns of {self.max_tokens_per_turn} tokens, "
            f"reward={self.reward}" + (f" + {self.reward_weight:g} x reward group" if self.reward_weight else "")
        ]
