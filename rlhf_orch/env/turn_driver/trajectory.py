"""One multi-turn trajectory, token in / token out (pure: no engine, no environment calls).

The engine's token ids are kept exactly as generated; observation tokens are appended as the
observation renderer gives them (`rlhf_orch.env.observations`), never re-tokenising what came
before. Every response token carries a loss-mask bit (1: the model's, trained on; 0: an
observation's, context only) and the engine's log-prob (0.0 on observation tokens).

The whole trajectory (every turn and observation) lives within the response budget
(`data.response_max_len`); each turn within `env.max_tokens_per_turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rlhf_orch.env.base import TrajectoryCounts


@dataclass
class TrajectoryLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_response_tokens: int  # data.response_max_len: the whole trajectory after the prompt
    max_observation_tokens: int
    max_prompt_tokens: int = 0  # data.prompt_max_len: a prompt env.init rewrote may be no longer (0: unchecked)


@dataclass
class EnvCounts(TrajectoryCounts):
    """Counters of one multi-turn trajectory beyond every driver's (`TrajectoryCounts`; masked:
    env.mask_failed / env.mask_truncated)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_errors: int = 0  # env.step raised (the trajectory ended there)
    env_timeouts: int = 0  # env.step ran past env.tool_timeout_s (the trajectory ended there)
    init_timeouts: int = (
        0  # env.make / env.init ran past the same deadline (the trajectory ended before its first turn)
    )
    close_timeouts: int = 0  # env.get_metrics / env.close ran past it (given up: the episode's metrics are lost)
    observations_truncated: int = 0  # observations whose content was cut to env.max_observation_tokens
    # observations whose chat-template frame alone exceeded env.max_observation_tokens: the trajectory ended there
    observations_too_long: int = 0
    closing_tokens_added: int = 0  # turns that did not end with the end-of-turn token: it was added as context
    tokenization_mismatches: int = 0  # the context differed from the chat template's rendering (the check)
    postprocessed_actions: int = 0  # turns the environment shortened (skyrl-gym's postprocessed_action)
    env_seconds: float = 0.0  # time inside env.init / env.step


@dataclass
class Trajectory:
    """Sample `index` of the rollout: its prompt and everything after it."""

    index: int
    prompt_ids: list[int]
    limits: TrajectoryLimits
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    counts: EnvCounts = field(default_factory=EnvCounts)
    truncated: bool = False  # stopped by a token budget or max_turns, not by the environment
    done: bool = False
    last_turn_hit_length: bool = False
    # The conversation so far as chat messages (the prompt, each turn as decoded, each observation as
    # rendered) and each model turn's token ids: what the tokenization check renders.
    messages: list[dict] = field(default_factory=list)
    turns: list[list[int]] = field(default_factory=list)
    turn_messages: list[int] = field(default_factory=list)  # where each model turn is in `messages`
    turn_ends: list[int] = field(default_factory=list)  # per model turn: its end in `response_ids`
    env_metrics: tuple[str, dict] | None = None  # (the environment's class, its get_metrics()) once closed

    def context(self) -> list[int]:
        """What the engine continues from: the prompt and every token since."""
        return self.prompt_ids + self.response_ids

    def next_turn_budget(self) -> int:
        """Tokens the next model turn may generate (0: no room left)."""
        return max(0, min(self.limits.max_tokens_per_turn, self.limits.max_response_tokens - len(self.response_ids)))

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], hit_length: bool) -> None:
        """The model's turn, exactly as the engine generated it."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"turn of sample {self.index}: {len(token_ids)} tokens but {len(logprobs)} log-probs")
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.loss_mask.extend([1] * len(token_ids))
        self.turns.append([int(t) for t in token_ids])
        self.turn_ends.append(len(self.response_ids))
        self.counts.turns += 1
        self.last_turn_hit_length = hit_length

    def shorten_last_turn(self, keep: int) -> None:
        """Keep the first `keep` tokens of the last turn (the environment used only those)."""
        drop = len(self.turns[-1]) - keep
        if drop <= 0:
            return
        self.turns[-1] = self.turns[-1][:keep]
        self.turn_ends[-1] -= drop
        del self.response_ids[-drop:], self.logprobs[-drop:], self.loss_mask[-drop:]
        self.counts.postprocessed_actions += 1
        self.last_turn_hit_length = False

    def add_observation(self, token_ids: Sequence[int], truncated: bool = False) -> bool:
        """Append an observation's tokens (rendered within env.max_observation_tokens; `truncated`: its
        content was cut). False, and the trajectory ends truncated, when the observation and one more
        model token do not fit the response budget."""
        ids = [int(t) for t in token_ids]
        if len(ids) > self.limits.max_observation_tokens:
            raise ValueError(
                f"sample {self.index}: an observation of {len(ids)} tokens is over env.max_observation_tokens"
            )
        self.counts.observations_truncated += int(truncated)
        if len(self.response_ids) + len(ids) + 1 > self.limits.max_response_tokens:
            self.finish(truncated=True)
            return False
        self.response_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.counts.observation_tokens += len(ids)
        return True

    def end_unstarted(self, end_of_turn: int) -> None:
        """The environment never started: the sample's response is one end-of-turn token, masked out
        (trained on nothing, as an agent that made no call), and the trajectory ends."""
        self.response_ids, self.logprobs, self.loss_mask = [int(end_of_turn)], [0.0], [0]
        self.finish(truncated=True)

    def finish(self, truncated: bool = False) -> None:
        self.done = True
        self.truncated = self.truncated or truncated
        self.counts.truncated = int(self.truncated)

    def wants_another_turn(self) -> bool:
        """After an environment step that was not `done`: is there a turn and room left?"""
        if self.counts.turns >= self.limits.max_turns or self.next_turn_budget() == 0:
            self.finish(truncated=True)
            return False
        return True

    def reward(self, how: str) -> float:
        """env.reward: the last step's reward, or the sum over steps (`sum`, and `per_turn`, whose
        trajectory score is the sum and whose turns' shares are placed by `turn_reward_field`)."""
        if not self.turn_rewards:
            return 0.0
        return self.turn_rewards[-1] if how == "last" else float(sum(self.turn_rewards))

    def turn_reward_field(self) -> list[float]:
        """env.reward=per_turn: per response token, each model turn's reward on the turn's last
        token, 0 elsewhere. The reward of step k belongs to turn k (the action it judged). A turn
        with no token of its own (an empty generation) gives its reward to the last model token
        before it; before the first model token there is none to credit, and the estimator puts
        whatever the field leaves out on the sequence's last token (`ppo_math.token_rewards`)."""
        placed = [0.0] * len(self.response_ids)
        for end, reward in zip(self.turn_ends, self.turn_rewards):
            last = end - 1
            while last >= 0 and not self.loss_mask[last]:
                last -= 1
            if last >= 0:
                placed[last] += float(reward)
        return placed
