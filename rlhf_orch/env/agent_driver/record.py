"""The token record of one agent trajectory (`env=agent`): every chat-completions call it made,
merged into token sequences with a loss mask (pure: no engine, no HTTP).

A call is recorded as the engine saw it: the prompt's token ids (the chat template's rendering of
the messages the agent sent) and the completion's token ids and log-probs, exactly as generated.
A call whose prompt starts, token for token, with an earlier sequence of the trajectory (its
prompt, every completion and everything between) extends that sequence: the new prompt tokens
after it are context (loss mask 0: the tool results and messages the agent appended), the
completion is the model's (loss mask 1). Nothing is re-tokenised: the merged sequence holds the
engine's own ids. A call that extends no sequence starts a new one (a second conversation, or
history the agent rewrote) and is counted as unmerged; every sequence trains, with the
trajectory's reward (`trained_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rlhf_orch.env.base import TrajectoryCounts


@dataclass
class AgentLimits:
    max_prompt_tokens: int  # data.prompt_max_len: a sequence's first prompt
    max_response_tokens: int  # data.response_max_len: everything after it
    max_tokens_per_call: int  # env.max_tokens_per_turn
    max_calls: int  # env.max_calls: per trajectory


# An agent's own numeric metrics (a dict result's entries besides `score`) among its counters.
AGENT_METRIC_PREFIX = "agent_metric/"


class CallRefused(ValueError):
    """A call the trajectory's limits leave no room for (answered with HTTP 400 and `kind` as the
    error's type: OpenAI's `context_length_exceeded` where the budget is spent, another where a
    retry later could succeed)."""

    def __init__(self, message: str, kind: str = "context_length_exceeded"):
        super().__init__(message)
        self.kind = kind


@dataclass
class TokenSequence:
    """One conversation of the trajectory, as the trainers see a sample."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: int = 0
    last_hit_length: bool = False

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        whole = self.tokens()
        return len(prompt_ids) >= len(whole) and list(prompt_ids[: len(whole)]) == whole


@dataclass
class AgentCounts(TrajectoryCounts):
    """Counters of one agent trajectory beyond every driver's (`TrajectoryCounts`; masked: the agent
    made no model call)."""

    calls: int = 0
    unmerged_calls: int = 0  # calls that started a new sequence after the first
    refused_calls: int = 0  # calls answered with an error (bad parameters, no budget left)
    agent_errors: int = 0  # the agent function raised
    agent_timeouts: int = 0  # the agent function ran past env.timeout_s
    completion_tokens: int = 0
    agent_seconds: float = 0.0  # wall time inside the agent function, generation excluded
    generation_seconds: float = 0.0  # wall time its calls waited for the engine


class AgentRecord:
    """Trajectory `index`: its sequences, in the order they began."""

    def __init__(self, index: int, limits: AgentLimits):
        self.index = index
        self.limits = limits
        self.sequences: list[TokenSequence] = []
        self.counts = AgentCounts()
        # Calls admitted and not yet recorded (an agent may make several at once), and the
        # conversations they extend: what `admit` counts before the calls' `add`.
        self._in_flight = 0
        self._extending: set[int] = set()

    def _extended(self, prompt_ids: Sequence[int]) -> TokenSequence | None:
        # The longest sequence the prompt extends (a later conversation may have grown from it).
        best = None
        for seq in self.sequences:
            if seq.extended_by(prompt_ids) and (best is None or len(seq.tokens()) > len(best.tokens())):
                best = seq
        return best

    def admit(self, prompt_ids: Sequence[int], requested: int | None) -> tuple[int, int | None]:
        """`budget` for a call about to be generated, and the call counted from now on: calls in
        flight count against env.max_calls, and a conversation takes one call at a time (a second
        call extending it before the first is recorded would, once the first is, extend nothing and
        start a sequence past data.prompt_max_len). Returns (tokens, ticket): hand the ticket to
        `done` when the call is answered or failed. CallRefused when it may not be made."""
        seq = self._extended(prompt_ids)
        if seq is not None and id(seq) in self._extending:
            raise CallRefused(
                "a call extending this conversation is still being answered: a conversation takes one call at a time "
                "(calls on other conversations may run at once)",
                kind="conversation_busy",
            )
        tokens = self.budget(prompt_ids, requested)
        self._in_flight += 1
        ticket = id(seq) if seq is not None else None
        if ticket is not None:
            self._extending.add(ticket)
        return tokens, ticket

    def done(self, ticket: int | None) -> None:
        """A call `admit` let through was answered (record it with `add`) or failed."""
        self._in_flight -= 1
        self._extending.discard(ticket)

    def budget(self, prompt_ids: Sequence[int], requested: int | None) -> int:
        """Tokens a call with this prompt may generate; CallRefused when none."""
        lim = self.limits
        if self.counts.calls + self._in_flight >= lim.max_calls:
            raise CallRefused(f"this trajectory made its {lim.max_calls} calls (env.max_calls)")
        seq = self._extended(prompt_ids)
        if seq is None:
            if len(prompt_ids) > lim.max_prompt_tokens:
                raise CallRefused(
                    f"the prompt is {len(prompt_ids)} tokens and starts a new sequence; a sequence's first prompt "
                    f"may be at most {lim.max_prompt_tokens} (data.prompt_max_len)"
                )
            used = 0
        else:
            used = len(prompt_ids) - len(seq.prompt_ids)
        room = lim.max_response_tokens - used
        if room <= 0:
            raise CallRefused(
                f"the conversation has used its {lim.max_response_tokens} response tokens (data.response_max_len); "
                "nothing more can be generated in it"
            )
        cap = min(room, lim.max_tokens_per_call)
        return cap if requested is None else max(1, min(cap, int(requested)))

    def add(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float], hit_length: bool
    ) -> None:
        """One finished call, exactly as the engine generated it."""
        if len(completion_ids) != len(logprobs):
            raise ValueError(
                f"call of trajectory {self.index}: {len(completion_ids)} tokens but {len(logprobs)} log-probs"
            )
        prompt_ids = [int(t) for t in prompt_ids]
        seq = self._extended(prompt_ids)
        if seq is None:
            if self.sequences:
                self.counts.unmerged_calls += 1
            seq = TokenSequence(prompt_ids)
            self.sequences.append(seq)
        else:
            context = prompt_ids[len(seq.tokens()) :]
            seq.response_ids.extend(context)
            seq.logprobs.extend([0.0] * len(context))
            seq.loss_mask.extend([0] * len(context))
            self.counts.observation_tokens += len(context)
        seq.response_ids.extend(int(t) for t in completion_ids)
        seq.logprobs.extend(float(x) for x in logprobs)
        seq.loss_mask.extend([1] * len(completion_ids))
        seq.calls += 1
        seq.last_hit_length = hit_length
        self.counts.calls += 1
        self.counts.completion_tokens += len(completion_ids)

    def trained_sequences(self, fallback_prompt_ids: Sequence[int], eos_id: int) -> list[TokenSequence]:
        """The sequences the trajectory trains as, each with its reward. First the one holding the
        most of the model's tokens (the first begun on a tie): it stands for the trajectory where
        one sequence must (its sample index, its group, its length in the metrics); then the
        others in the order they began. An agent that made no call trains nothing: one EOS,
        masked out."""
        if not self.sequences:
            return [TokenSequence(list(fallback_prompt_ids), [int(eos_id)], [0.0], [0])]
        first = max(range(len(self.sequences)), key=lambda k: (sum(self.sequences[k].loss_mask), -k))
        return [self.sequences[first]] + [s for k, s in enumerate(self.sequences) if k != first]
