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

Branches: a call continues a sequence from the last call boundary its prompt shares with it (the end
of the sequence's first prompt or of one of its completions; `admit`'s ticket holds it). Where that is
the sequence's end, the call extends it; elsewhere -- two calls extending one conversation at once
(best-of-n, a tree search), an agent going back to an earlier point, a chat template that renders
earlier turns differently, the n completions of a call with n > 1 -- the call becomes a sequence of
its own, a copy of the shared history up to the boundary (the same prompt, so shared-prompt training
packs them together), counted in `branches`; what its prompt holds after the boundary is context.

Per token, the temperature it was sampled at (`TokenSequence.temperatures`; 0 where the run's
setting applies: context, and calls that set none): the trainers score each token at it. A token
picked greedily (temperature 0) was drawn from no distribution a policy gradient could weigh, and one
drawn with top-p / top-k / penalties from a distribution the trainers do not score (the whole
vocabulary at the temperature): these stay in the sequence as context (loss mask 0), counted in
`greedy_tokens` / `truncated_sampling_tokens` -- the latter are trained when the run corrects for the
engine's distribution with importance weights (`train_truncated_sampling`).
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
    # Per response token, the temperature it was sampled at; 0: the run's (algo.temperature).
    temperatures: list[float] = field(default_factory=list)
    calls: int = 0
    last_hit_length: bool = False
    call_ends: list[int] = field(default_factory=list)  # token positions where each completion ended

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def boundary_in(self, prompt_ids: Sequence[int]) -> int | None:
        """The last call boundary up to which `prompt_ids` holds this sequence's tokens (the end of
        its first prompt or of a completion); None when the prompt does not start with its first prompt."""
        whole, n = self.tokens(), min(len(prompt_ids), len(self.tokens()))
        same = next((k for k in range(n) if whole[k] != prompt_ids[k]), n)
        ends = [b for b in (len(self.prompt_ids), *self.call_ends) if b <= same]
        return max(ends) if ends else None


@dataclass
class AgentCounts(TrajectoryCounts):
    """Counters of one agent trajectory beyond every driver's (`TrajectoryCounts`; masked: the agent
    made no model call)."""

    calls: int = 0
    unmerged_calls: int = 0  # calls that started a new sequence after the first
    branches: int = 0  # sequences begun as a copy of another's history (forked calls, n > 1)
    greedy_tokens: int = 0  # tokens of temperature-0 calls: context, not trained on
    # tokens drawn with top-p / top-k / penalties (the engine's distribution, not the trained policy's)
    truncated_sampling_tokens: int = 0
    truncated_sampling_context_tokens: int = 0  # of those, kept as context: the run does not correct for them
    refused_calls: int = 0  # calls answered with an error (bad parameters, no budget left)
    sampling_overridden: int = 0  # env.sampling=run: calls whose own sampling settings were replaced
    agent_errors: int = 0  # the agent function raised
    agent_timeouts: int = 0  # the agent function ran past env.timeout_s
    completion_tokens: int = 0
    agent_seconds: float = 0.0  # wall time inside the agent function, generation excluded
    generation_seconds: float = 0.0  # wall time its calls waited for the engine


@dataclass
class Branch:
    """Where an admitted call branches off: the sequence its prompt extends (None: it starts one)
    and that sequence's length when the call was made. The call's completions are recorded there:
    the first extends the sequence if nothing has since, every other one is a branch."""

    sequence: TokenSequence | None
    length: int  # the boundary the call continues from
    calls: int = 1  # completions asked for (n)


class AgentRecord:
    """Trajectory `index`: its sequences, in the order they began."""

    def __init__(self, index: int, limits: AgentLimits, train_truncated_sampling: bool = False):
        self.index = index
        self.limits = limits
        # top-p / top-k / penalised tokens trained (the run corrects with importance weights) or context
        self.train_truncated_sampling = train_truncated_sampling
        self.sequences: list[TokenSequence] = []
        self.counts = AgentCounts()
        self._in_flight = 0  # completions admitted and not yet recorded (an agent may make several calls at once)

    def _origin(self, prompt_ids: Sequence[int]) -> tuple[TokenSequence, int] | None:
        """The sequence a call with this prompt continues and the boundary it continues from: the
        furthest one of any sequence (its end where the prompt extends it: no copy); None: the
        prompt shares no sequence's first prompt."""
        best: tuple[TokenSequence, int] | None = None
        for seq in self.sequences:
            b = seq.boundary_in(prompt_ids)
            if b is None or (best is not None and b < best[1]):
                continue
            if best is None or b > best[1] or (b == len(seq.tokens()) and best[1] != len(best[0].tokens())):
                best = (seq, b)
        return best

    def admit(self, prompt_ids: Sequence[int], requested: int | None, n: int = 1) -> tuple[int, Branch]:
        """`budget` for a call of n completions about to be generated, and the call counted from now
        on (calls in flight count against env.max_calls, each completion as one call). Returns
        (tokens, branch): record each completion with `add(..., branch=branch)` and hand the branch
        to `done` when the call is answered or failed. CallRefused when it may not be made."""
        tokens = self.budget(prompt_ids, requested, n)
        self._in_flight += n
        origin = self._origin(prompt_ids)
        return tokens, Branch(*(origin or (None, 0)), n)

    def done(self, branch: Branch) -> None:
        """A call `admit` let through was answered (its completions recorded with `add`) or failed."""
        self._in_flight -= branch.calls

    def budget(self, prompt_ids: Sequence[int], requested: int | None, n: int = 1) -> int:
        """Tokens each of n completions of a call with this prompt may generate; CallRefused when none."""
        lim = self.limits
        if self.counts.calls + self._in_flight + n > lim.max_calls:
            made = self.counts.calls + self._in_flight
            raise CallRefused(
                f"this trajectory made {made} of its {lim.max_calls} calls (env.max_calls; each of n completions "
                f"counts), {n} more asked"
                if n > 1
                else f"this trajectory made its {lim.max_calls} calls (env.max_calls)"
            )
        origin = self._origin(prompt_ids)
        seq = origin[0] if origin is not None else None
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

    def _branch_off(self, seq: TokenSequence, length: int) -> TokenSequence:
        """A new sequence holding `seq`'s first `length` tokens (the history a call branched from)."""
        r = length - len(seq.prompt_ids)
        copy = TokenSequence(
            list(seq.prompt_ids),
            seq.response_ids[:r],
            seq.logprobs[:r],
            seq.loss_mask[:r],
            seq.temperatures[:r],
            calls=sum(end <= length for end in seq.call_ends),
            call_ends=[end for end in seq.call_ends if end <= length],
        )
        self.sequences.append(copy)
        self.counts.branches += 1
        return copy

    def _sequence_for(self, prompt_ids: list[int], branch: Branch | None) -> TokenSequence | None:
        """The sequence a completion of this prompt extends (None: it starts a new one)."""
        if branch is None:  # recorded without admission: where the prompt continues from now
            origin = self._origin(prompt_ids)
            branch = Branch(*(origin or (None, 0)))
        seq = branch.sequence
        if seq is None:  # the call starts a conversation: its first completion does, the others branch from it
            return None
        if len(seq.tokens()) != branch.length:  # it goes on past the boundary (since, or already): a branch
            return self._branch_off(seq, branch.length)
        return seq

    def add(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        hit_length: bool,
        temperature: float | None = None,
        branch: Branch | None = None,
        truncated_sampling: bool = False,
    ) -> None:
        """One finished completion, exactly as the engine generated it; `temperature`: the one it was
        sampled at when the call set one (None: the run's; 0: greedy, kept as context);
        `truncated_sampling`: drawn with top-p / top-k / penalties (counted; context unless
        `train_truncated_sampling`)."""
        if len(completion_ids) != len(logprobs):
            raise ValueError(
                f"call of trajectory {self.index}: {len(completion_ids)} tokens but {len(logprobs)} log-probs"
            )
        prompt_ids = [int(t) for t in prompt_ids]
        seq = self._sequence_for(prompt_ids, branch)
        if seq is None:
            if self.sequences:
                self.counts.unmerged_calls += 1
            seq = TokenSequence(prompt_ids)
            self.sequences.append(seq)
            if branch is not None:  # the call's other completions (n > 1) branch from its prompt
                branch.sequence, branch.length = seq, len(prompt_ids)
        else:
            context = prompt_ids[len(seq.tokens()) :]
            seq.response_ids.extend(context)
            seq.logprobs.extend([0.0] * len(context))
            seq.loss_mask.extend([0] * len(context))
            seq.temperatures.extend([0.0] * len(context))
            self.counts.observation_tokens += len(context)
        greedy = temperature is not None and temperature <= 0.0
        context_only = greedy or (truncated_sampling and not self.train_truncated_sampling)
        seq.response_ids.extend(int(t) for t in completion_ids)
        seq.logprobs.extend(float(x) for x in logprobs)
        seq.loss_mask.extend([0 if context_only else 1] * len(completion_ids))
        seq.temperatures.extend([0.0 if temperature is None or greedy else float(temperature)] * len(completion_ids))
        seq.calls += 1
        seq.call_ends.append(len(seq.tokens()))
        seq.last_hit_length = hit_length
        self.counts.calls += 1
        self.counts.completion_tokens += len(completion_ids)
        if greedy:
            self.counts.greedy_tokens += len(completion_ids)
        elif truncated_sampling:
            self.counts.truncated_sampling_tokens += len(completion_ids)
            if context_only:
                self.counts.truncated_sampling_context_tokens += len(completion_ids)

    def trained_sequences(self, fallback_prompt_ids: Sequence[int], eos_id: int) -> list[TokenSequence]:
        """The sequences the trajectory trains as, each with its reward. First the one holding the
        most of the model's tokens (the first begun on a tie): it stands for the trajectory where
        one sequence must (its sample index, its group, its length in the metrics); then the
        others in the order they began. An agent that made no call trains nothing: one EOS,
        masked out."""
        if not self.sequences:
            return [TokenSequence(list(fallback_prompt_ids), [int(eos_id)], [0.0], [0], [0.0])]
        first = max(range(len(self.sequences)), key=lambda k: (sum(self.sequences[k].loss_mask), -k))
        return [self.sequences[first]] + [s for k, s in enumerate(self.sequences) if k != first]
