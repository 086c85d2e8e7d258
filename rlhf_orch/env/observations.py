"""Observation messages -> token ids, appended after the model's tokens (never re-tokenising them).

`chat_template`: the context a turn is generated from is what the tokenizer's chat template renders
for the conversation so far, the model's own tokens kept as generated. The template closes an
assistant turn with its end-of-turn token and often more (ChatML: `<|im_end|>` then `\\n`); the
engine stops at the end-of-turn token and never writes what follows it. So an observation is the
template's rendering of a fixed conversation plus the new messages, cut after the base
conversation's last end-of-turn token (SkyRL cuts its base conversation the same way): it begins
with the rest of the template's turn close. A turn that did not end with the end-of-turn token (cut
at its token limit, stopped by a stop string, shortened by the environment) gets the token as
context first (loss mask 0), so the next turn still starts where the template would start it.
`plain`: the messages' contents, tokenised as text without special tokens (models whose template
renders no tool or user turns, like the tiny tool-use model).

Long observations are cut on their content (`env.observation_truncate_side`: which side of the
content goes), then rendered: the template's closing tokens and the next turn's header are never cut.
Where the template's own tokens around the messages alone exceed the limit (a turn answered with
dozens of tool messages) nothing can be cut to fit: `ObservationTooLong`, and the runner ends that
trajectory there (counted).

Templates that stamp today's date (Llama-3.1/3.2-Instruct's `Today Date`, through transformers'
`strftime_now`) are rendered with a `FixedClock`: one instant for every rendering of a run -- the
prompts on the driver, observations and the check on the engines -- so a run crossing midnight still
continues its prompts exactly.

`matches_template` renders a whole conversation with the model's turns put back as generated: the
tokenization check (`env.tokenization_sanity_check_mode`) compares it with the context a
trajectory was really generated from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from rlhf_orch.env.base import EnvError

# The fixed conversation the new messages are rendered after (its own tokens are dropped).
_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
FORMATS = ("chat_template", "plain")
# env.tokenization_sanity_check_mode: a mismatch ends the run, is logged once and counted, or nothing.
CHECK_MODES = ("strict", "warn", "off")
# Which side of a too-long observation's content is cut: the end, the start, or the middle.
TRUNCATE_SIDES = ("tail", "head", "middle")
_MIDDLE_MARK = "\n...\n"
# Stands in for an assistant turn's content when a conversation is rendered around the model's tokens.
_TURN_MARK = "\u2063rlhf-orch-turn-{}\u2063"


@dataclass(frozen=True)
class FixedClock:
    """`strftime_now` for chat templates (transformers passes its own, which reads the clock at every
    rendering): `at`'s local time, whenever it is called. Passed as a template variable it takes the
    place of transformers' (a render's variables come before the environment's globals)."""

    at: float  # seconds since the epoch

    def __call__(self, fmt: str) -> str:
        return datetime.fromtimestamp(self.at).strftime(fmt)


class ObservationTooLong(EnvError):
    """The chat template's own tokens around these observation messages exceed env.max_observation_tokens
    (no content left to cut): what the model's turn asked for cannot be shown to it."""


@dataclass
class RenderedObservation:
    ids: list[int]
    truncated: bool  # some message's content was cut to fit env.max_observation_tokens
    messages: list[dict]  # the messages as rendered (contents cut where truncated)
    closing_added: bool = False  # the template's end-of-turn token was put first (the turn had none)


def token_ids(out: Any) -> list[int]:
    """Token ids out of apply_chat_template / a tokenizer call (a list, or a BatchEncoding)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # BatchEncoding in newer transformers
        out = out["input_ids"]
    return [int(t) for t in out]


def stop_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> set[int]:
    """The token ids an engine ends a turn on: the tokenizer's EOS and `extra` (the generation
    config's EOS ids: models whose template closes turns with a token other than the tokenizer's EOS)."""
    ids = {int(t) for t in extra}
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return ids


class ObservationRenderer:
    def __init__(
        self,
        tokenizer: Any,
        fmt: str,
        truncate_side: str = "tail",
        stop_ids: Iterable[int] = (),
        template_kwargs: Mapping[str, Any] | None = None,
        clock: FixedClock | None = None,
    ):
        if fmt not in FORMATS:
            raise EnvError(f"env.observation_format={fmt!r}: must be one of {', '.join(FORMATS)}")
        if truncate_side not in TRUNCATE_SIDES:
            raise EnvError(
                f"env.observation_truncate_side={truncate_side!r}: must be one of {', '.join(TRUNCATE_SIDES)}"
            )
        self.tokenizer = tokenizer
        self.format = fmt
        self.truncate_side = truncate_side
        self.stop_ids = stop_token_ids(tokenizer, stop_ids)
        self.template_kwargs = dict(template_kwargs or {})
        # One date for everything this renderer renders (the run's, from the env option, where given).
        self.clock = clock or FixedClock(time.time())
        self._frame: tuple[list[int], int | None] | None = None
        self._rendered_roles: set[tuple[str, ...]] = set()  # observation roles seen rendered by the template

    # ------------------------------------------------------------------ the template
    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool, tokenize: bool = True) -> Any:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=generation_prompt,
            tokenize=tokenize,
            **self._dated(),
            **self.template_kwargs,
        )
        return token_ids(out) if tokenize else out

    def _dated(self) -> dict[str, Any]:
        """The fixed clock, for a template that reads one (the others are rendered as they always were)."""
        return (
            {"strftime_now": self.clock}
            if "strftime_now" in str(getattr(self.tokenizer, "chat_template", "") or "")
            else {}
        )

    def _tokens(self, text: str) -> list[int]:
        return token_ids(self.tokenizer(text, add_special_tokens=False))

    def frame(self) -> tuple[list[int], int | None]:
        """(the base conversation's ids up to and with its last end-of-turn token, that token); the
        whole base and None where the template closes no turn with a token the engine stops on."""
        if self._frame is None:
            base = self._render(_BASE, generation_prompt=False)
            cut = max((i for i, t in enumerate(base) if t in self.stop_ids), default=None)
            self._frame = (base[: cut + 1], base[cut]) if cut is not None else (base, None)
        return self._frame

    def closes_turn(self, token_ids: Sequence[int]) -> bool:
        """The turn ended with the template's end-of-turn token (what the context after it assumes)."""
        if self.format == "plain":  # no template: the engine's stop tokens
            return bool(token_ids) and int(token_ids[-1]) in self.stop_ids
        close = self.frame()[1]
        return bool(token_ids) and close is not None and int(token_ids[-1]) == close

    def end_of_turn_id(self) -> int:
        """The token a model turn ends with: the template's end-of-turn token, else the tokenizer's EOS."""
        close = self.frame()[1] if self.format == "chat_template" else None
        if close is not None:
            return int(close)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return int(eos) if isinstance(eos, int) else min(self.stop_ids, default=0)

    def renders_prompts(self) -> bool:
        """Prompts are rendered here again: the template takes options (env.chat_template_kwargs),
        which the data's rendering of the rows had too (`PromptSource.render_prompts_with`)."""
        return self.format == "chat_template" and bool(self.template_kwargs)

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A whole prompt an environment rewrote in `init`: the chat template with the generation
        prompt (as `data.chat_template=true` renders rows)."""
        return self._render(messages, generation_prompt=True)

    # ------------------------------------------------------------------ observations
    def _delta(self, messages: Sequence[Mapping[str, Any]], turn_closed: bool) -> list[int]:
        if self.format == "plain":
            return self._tokens("".join(str(m.get("content", "")) for m in messages))
        base, close = self.frame()
        full = self._render([*_BASE, *messages], generation_prompt=True)
        if full[: len(base)] == base:
            new = full[len(base) :]  # no end-of-turn token in the template: whatever follows the base
        else:  # the assistant turn rendered otherwise once messages follow it (Qwen3's <think> block)
            new = self._after_turn(messages, close)
        return new if close is None or turn_closed else [close, *new]

    def _after_turn(self, messages: Sequence[Mapping[str, Any]], close: int | None) -> list[int]:
        """What the template renders after an assistant turn's content, past its end-of-turn token,
        for a template whose rendering of a conversation is no prefix of its continuation's: the
        turn's content is a marker, and the text after it is tokenised alone."""
        mark = _TURN_MARK.format(0)
        text = self._render(
            [_BASE[0], {"role": "assistant", "content": mark}, *messages], generation_prompt=True, tokenize=False
        )
        _, found, after = text.partition(mark)
        ids = self._tokens(after)
        if not found or (close is not None and close not in ids):
            raise EnvError(
                "env.observation_format=chat_template: this tokenizer's chat template does not render an assistant "
                "turn's content as given, closed by its end-of-turn token; use env.observation_format=plain"
            )
        return ids[ids.index(close) + 1 :] if close is not None else ids

    def renders_turns_alike(self) -> bool:
        """A conversation's rendering is a prefix of its continuation's: the template renders an
        assistant turn the same whether it is the last message or not (what a context kept as
        generated needs to match the template exactly). Not so for Qwen3's: the last turn gets a
        <think> block that earlier turns lose."""
        if self.format != "chat_template":
            return True
        base, _ = self.frame()
        return self._render([*_BASE, {"role": "user", "content": "again"}], generation_prompt=True)[: len(base)] == base

    def __call__(self, messages: Sequence[Mapping[str, Any]], turn_closed: bool = True) -> list[int]:
        return self.observation(messages, turn_closed, None).ids

    def observation(
        self, messages: Sequence[Mapping[str, Any]], turn_closed: bool, max_tokens: int | None
    ) -> RenderedObservation:
        """The tokens after a model turn: the messages rendered, their contents cut so that the whole
        fits `max_tokens` (the template's own tokens are never cut). No messages under a chat template
        still close the turn and open the next one (what the template renders for two turns in a row)."""
        if not messages and self.format == "plain":
            return RenderedObservation([], False, [])
        closing = self.format == "chat_template" and not turn_closed and self.frame()[1] is not None
        ids = self._delta(messages, turn_closed)
        empty = [{**m, "content": ""} for m in messages]
        roles = tuple(sorted({str(m.get("role")) for m in messages}))
        if (
            self.format == "chat_template"
            and roles not in self._rendered_roles
            and any(str(m.get("content", "")) for m in messages)
        ):
            if ids == self._delta(empty, turn_closed):
                raise EnvError(
                    "env.observation_format=chat_template: this tokenizer's chat template renders none of the "
                    f"roles {list(roles)}; use env.observation_format=plain"
                )
            self._rendered_roles.add(roles)  # (only once seen rendering content)
        if max_tokens is None or len(ids) <= max_tokens:
            return RenderedObservation(ids, False, [dict(m) for m in messages], closing)
        frame = len(self._delta(empty, turn_closed))
        if frame > max_tokens:
            raise ObservationTooLong(
                f"env.max_observation_tokens={max_tokens}: the chat template alone takes {frame} tokens around "
                f"these {len(messages)} observation message(s); raise it to at least {frame + 16}"
            )
        contents = [self._tokens(str(m.get("content", ""))) for m in messages]
        budget = max_tokens - frame
        for _ in range(8):  # re-tokenising cut text can merge differently: shrink until it fits
            cut = [
                {**m, "content": self._cut(c, share)}
                for m, c, share in zip(messages, contents, _shares(contents, budget))
            ]
            ids = self._delta(cut, turn_closed)
            if len(ids) <= max_tokens:
                return RenderedObservation(ids, True, cut, closing)
            budget -= len(ids) - max_tokens
        return RenderedObservation(self._delta(empty, turn_closed), True, empty, closing)

    def _cut(self, content: list[int], keep: int) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        if keep >= len(content):
            return decode(content)
        if keep <= 0:
            return ""
        if self.truncate_side == "tail":
            return decode(content[:keep])
        if self.truncate_side == "head":
            return decode(content[len(content) - keep :])
        mark = len(self._tokens(_MIDDLE_MARK))
        if keep <= mark + 1:  # no room for both ends and the marker: keep the start
            return decode(content[:keep])
        room = keep - mark
        head = (room + 1) // 2
        tail = room - head
        return decode(content[:head]) + _MIDDLE_MARK + (decode(content[len(content) - tail :]) if tail else "")

    # ------------------------------------------------------------------ the tokenization check
    def matches_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        turns: Sequence[Sequence[int]],
        context: Sequence[int],
        turn_at: Sequence[int],
    ) -> tuple[bool, list[int]]:
        """Is `context` the chat template's rendering of `messages` (assistant messages in order =
        the model's `turns`, kept as generated)? Two readings count: the template's text around each
        turn tokenised piece by piece, the turn's own tokens between (exact where a special token
        bounds every turn: ChatML, Llama-3); or the whole text, turns decoded, tokenised at once (word
        tokenizers that fold the space before a turn into its first token, like the tiny model's).
        `turn_at[k]` is where turn k is in `messages` (the prompt may hold assistant messages of its
        own: few-shot examples, a conversation's history). Returns (match, the piecewise reading)."""
        if self.format != "chat_template":
            raise ValueError("the tokenization check needs env.observation_format=chat_template")
        if len(turn_at) != len(turns):
            raise ValueError(f"{len(turn_at)} turn positions but {len(turns)} model turns")
        marked = [dict(m) for m in messages]
        for k, at in enumerate(turn_at):
            marked[at] = {**messages[at], "content": _TURN_MARK.format(k)}
        ends_with_turn = bool(turn_at) and turn_at[-1] == len(messages) - 1
        text = self._render(marked, generation_prompt=not ends_with_turn, tokenize=False)
        pieces, rest = [], text
        for i in range(len(turns)):
            before, sep, rest = rest.partition(_TURN_MARK.format(i))
            if not sep:
                return False, []  # the template rewrote an earlier turn (e.g. dropped its reasoning)
            pieces.append(before)
        context = [int(t) for t in context]
        piecewise: list[int] = []
        whole = ""
        for i, (before, turn) in enumerate(zip(pieces, turns)):
            last = i == len(turns) - 1 and ends_with_turn
            own = list(turn) if last or not self.closes_turn(turn) else list(turn[:-1])
            piecewise += self._tokens(before) + own
            whole += before + self.tokenizer.decode(own, skip_special_tokens=False)
        if not ends_with_turn:
            piecewise += self._tokens(rest)
            whole += rest
        return piecewise == context or self._tokens(whole) == context, piecewise


def _shares(lengths: Sequence[Sequence[int]], budget: int) -> list[int]:
    """Split `budget` tokens over messages: short ones whole, the rest an equal share of what is left."""
    sizes = [len(x) for x in lengths]
    shares = [0] * len(sizes)
    left, open_ = budget, sorted(range(len(sizes)), key=lambda i: sizes[i])
    while open_:
        each = left // len(open_)
        i = open_[0]
        if sizes[i] <= each:
            shares[i] = sizes[i]
            left -= sizes[i]
            open_.pop(0)
            continue
        for j in open_:
            shares[j] = each
        break
    return shares
