"""Drive many multi-turn trajectories through one engine at once.

Trajectories progress independently: while one waits for its environment, the engine keeps
generating the others' turns; a batch ends when every trajectory is done or hit a limit. At most
`concurrency` trajectories are in flight; the rest wait to start. Every call into an environment --
`make` with `init`, each `step`, `get_metrics` with `close` -- runs on a thread of its own with the
same deadline (`step_timeout_s`: `env.tool_timeout_s`; `rlhf_orch.env.turn_driver.abandonable`), so
one that hangs is given up and counted (a hung start ends its trajectory before its first turn, a
hung step ends it there, a hung close loses its episode metrics) and never holds the engine or the
other trajectories.

The engine side is a `TurnGenerator` (the vLLM engine supplies one; tests a scripted one) and the
chat template an `ObservationRenderer`, so this module is pure: no vLLM, no Ray.

Every finished trajectory can be checked against the chat template (`check`: strict / warn / off,
veRL's tokenization sanity check): the context it was generated from must equal the template's
rendering of its conversation with the model's tokens kept as generated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.turn_driver import abandonable
from rlhf_orch.env.base import StepResult, TextEnv, call_env, env_class_key, is_async, prompt_messages
from rlhf_orch.env.observations import CHECK_MODES, ObservationTooLong
from rlhf_orch.env.turn_driver.trajectory import Trajectory, TrajectoryLimits

logger = logging.getLogger(__name__)

# Numeric step-metadata keys an environment may report (the python tool does); summed per rollout.
TOOL_COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts")


@dataclass
class TurnOutput:
    key: int  # the trajectory's sample index
    token_ids: list[int]
    logprobs: list[float]
    hit_length: bool  # stopped at the turn's max_tokens, not at EOS


class TurnGenerator(Protocol):
    def submit(self, key: int, context: list[int], max_tokens: int, turn: int) -> None:
        """Start generating one turn of trajectory `key` after `context`."""

    def poll(self) -> list[TurnOutput]:
        """Advance generation a little; the turns that finished meanwhile."""

    def busy(self) -> bool:
        """Turns are being generated."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """A turn's text, as the environment reads it (special tokens skipped)."""

    def abort(self, keys: Sequence[int]) -> None:
        """Stop generating the turns of these trajectories (a rollout that failed leaves nothing running)."""


def _plain(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Episode metrics as plain numbers and strings: they travel in checkpoints, which load only those."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, str)):
            out[str(k)] = v
        elif isinstance(v, (int, float)) or hasattr(v, "__float__"):
            try:
                out[str(k)] = float(v)
            except (TypeError, ValueError):
                pass
    return out


class Rendering(Protocol):
    """How observations become tokens (`rlhf_orch.env.observations.ObservationRenderer`)."""

    format: str

    def observation(self, messages: Sequence[Mapping[str, Any]], turn_closed: bool, max_tokens: int | None) -> Any:
        """.ids (the tokens after the turn), .truncated, .messages (as rendered, contents cut)."""

    def closes_turn(self, token_ids: Sequence[int]) -> bool: ...

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def matches_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        turns: Sequence[Sequence[int]],
        context: Sequence[int],
        turn_at: Sequence[int],
    ) -> tuple[bool, list[int]]: ...

    def renders_prompts(self) -> bool: ...

    def end_of_turn_id(self) -> int:
        """The token a model turn ends with (what stands in for the turns of a trajectory that never started)."""


class EnvRuntimeError(RuntimeError):
    """An environment could not be built or initialised for a row (a bug in it or in the data)."""


class TokenizationMismatch(RuntimeError):
    """env.tokenization_sanity_check_mode=strict: a context differed from the chat template's."""


# A live trajectory's phases: its environment starting (env.make + env.init), its turns, its
# environment winding down (env.get_metrics + env.close), and done with.
OPENING, TURNS, CLOSING, CLOSED = "opening", "turns", "closing", "closed"


@dataclass
class _Live:
    trajectory: Trajectory
    prompt: Prompt
    env: TextEnv | None = None  # None until env.make returned (on the opening thread)
    phase: str = OPENING
    future: cf.Future | None = None  # the environment call running now (one at a time)
    deadline: float = 0.0
    started: float = 0.0
    loop: asyncio.AbstractEventLoop | None = None  # an `async def` environment's own event loop
    abandoned: bool = False  # a call ran past its deadline: its thread (and loop) are left to end
    opening: cf.Future | None = None  # env.make + env.init given up: closing waits for its thread to end first


class MultiTurnRunner:
    def __init__(
        self,
        make_env: Callable[[Prompt], TextEnv],
        generator: TurnGenerator,
        renderer: Rendering,
        limits: TrajectoryLimits,
        concurrency: int,
        step_timeout_s: float,
        check: str = "strict",
        action_decode: Callable[[Sequence[int]], str] | None = None,
    ):
        if check not in CHECK_MODES:
            raise ValueError(f"env.tokenization_sanity_check_mode={check!r}: must be one of {', '.join(CHECK_MODES)}")
        self.make_env = make_env
        self.generator = generator
        self.renderer = renderer
        self.limits = limits
        self.concurrency = concurrency
        self.step_timeout_s = step_timeout_s
        # How a model turn becomes the `action` env.step reads; None: the turn's text without special
        # tokens (skyrl-gym's contract; also what the conversation's messages hold).
        self.action_decode = action_decode
        # Only a chat-template rendering has a template to check against.
        self.check = check if renderer.format == "chat_template" else "off"
        self._warned = False

    def run(self, items: Sequence[tuple[int, Prompt, Sequence[int]]]) -> Iterator[Trajectory]:
        """Every (sample index, prompt, prompt ids) as a trajectory; yields each as it finishes."""
        waiting = deque(items)
        live: dict[int, _Live] = {}
        try:
            while waiting or live:
                while waiting and len(live) < self.concurrency:
                    index, prompt, ids = waiting.popleft()
                    live[index] = self._open(index, prompt, ids)
                for out in self.generator.poll() if self.generator.busy() else ():
                    self._turn_done(live[out.key], out)
                for entry in self._returned(live, block=not self.generator.busy()):
                    self._after_call(entry)
                for entry in live.values():
                    if entry.trajectory.done and entry.phase in (OPENING, TURNS) and entry.future is None:
                        self._wind_down(entry)
                finished = [i for i, e in live.items() if e.phase == CLOSED]
                for index in finished:
                    t = live.pop(index).trajectory
                    self._check(t)
                    yield t
                if live and not finished and not self.generator.busy() and all(e.future is None for e in live.values()):
                    raise RuntimeError(
                        f"multi-turn rollout stalled: {len(live)} trajectories neither generating nor stepping"
                    )
        finally:
            if live:  # the rollout failed (or its consumer stopped): the engine stops their turns
                self.generator.abort([i for i, e in live.items() if e.phase == TURNS])
                self._close_all(list(live.values()))

    # ------------------------------------------------------------------ environment calls
    def _call(self, entry: _Live, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`fn` on a thread of its own, given up at the deadline: it counts from the call's start, and
        a call that hangs holds no worker another trajectory's call would wait for."""
        entry.phase = phase
        entry.started = time.perf_counter()
        entry.deadline = time.monotonic() + self.step_timeout_s
        entry.future = abandonable.start(fn, *args, name=f"env-{phase}", **kwargs)

    def _returned(self, live: dict[int, _Live], block: bool) -> list[_Live]:
        """Entries whose environment call finished or ran past its deadline; waits for one when the
        engine is idle."""
        pending = {e.future: e for e in live.values() if e.future is not None}
        if not pending:
            return []
        timeout = 0.0
        if block:
            timeout = max(0.0, min(e.deadline for e in pending.values()) - time.monotonic())
        done, _ = cf.wait(list(pending), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        now = time.monotonic()
        return [e for f, e in pending.items() if f in done or now >= e.deadline]

    def _after_call(self, entry: _Live) -> None:
        future, entry.future = entry.future, None
        timed_out = not future.done()
        if timed_out:  # past its deadline: given up (`abandonable`), its thread ends on its own
            entry.abandoned = True
            abandonable.abandon(future)
            if entry.phase == OPENING:
                entry.opening = future
        if entry.phase != CLOSING:
            entry.trajectory.counts.env_seconds += time.perf_counter() - entry.started
        {OPENING: self._opened, TURNS: self._stepped, CLOSING: self._closed}[entry.phase](entry, future, timed_out)

    # ------------------------------------------------------------------ opening: env.make + env.init
    def _open(self, index: int, prompt: Prompt, ids: Sequence[int]) -> _Live:
        entry = _Live(Trajectory(index, list(ids), self.limits), prompt)
        self._call(entry, OPENING, self._make_and_init, entry)
        return entry

    def _make_and_init(self, entry: _Live) -> tuple[list[dict], Any]:
        """(On the opening thread.) The environment, kept on the entry as soon as it exists (so that a
        start given up still gets closed), initialised with the prompt's messages."""
        entry.env = self.make_env(entry.prompt)
        if entry.abandoned and entry.phase == CLOSED:
            # given up while it was being made, and wound down as never made: no one else closes it
            call_env(getattr(entry.env, "close", lambda: None))
            raise abandonable.Abandoned()
        if is_async(entry.env):
            entry.loop = asyncio.new_event_loop()
        messages = prompt_messages(entry.prompt)
        # (init gets its own copy: one that edits its argument in place has rewritten the prompt too)
        first, _ = call_env(entry.env.init, prompt_messages(entry.prompt), loop=entry.loop)
        return messages, first

    def _opened(self, entry: _Live, future: cf.Future, timed_out: bool) -> None:
        t = entry.trajectory
        if timed_out:  # counted; the sample still needs a response: one end-of-turn token, trained on nothing
            t.counts.init_timeouts += 1
            t.end_unstarted(self.renderer.end_of_turn_id())
            return
        try:
            messages, first = future.result()
        except Exception as e:  # named in one line for the driver
            raise EnvRuntimeError(
                f"the environment for sample {t.index} could not start: {type(e).__name__}: {e}"
            ) from e
        rewritten = first is not None and list(first) != messages
        if rewritten:
            messages = [dict(m) for m in first]
        if rewritten or self.renderer.renders_prompts():
            # the environment rewrote the prompt, or the template takes options (env.chat_template_kwargs:
            # tools, enable_thinking) -- the data rendered its rows with them too, measured against
            # data.prompt_max_len before Ray (`PromptSource.render_prompts_with`): the same ids again
            t.prompt_ids = self.renderer.prompt(messages)
            longest = self.limits.max_prompt_tokens
            if longest and len(t.prompt_ids) > longest:
                # (the engine's max_model_len has room for data.prompt_max_len + data.response_max_len only)
                by = "the environment's init" if rewritten else "the chat template with env.chat_template_kwargs"
                raise EnvRuntimeError(
                    f"sample {t.index}: {by} made the prompt {len(t.prompt_ids)} tokens, more than data.prompt_max_len={longest}: "
                    "shorten it, or raise data.prompt_max_len"
                )
        t.messages = [dict(m) for m in messages]
        entry.phase = TURNS
        self._next_turn(entry)

    # ------------------------------------------------------------------ turns: the engine, then env.step
    def _next_turn(self, entry: _Live) -> None:
        t = entry.trajectory
        self.generator.submit(t.index, t.context(), t.next_turn_budget(), t.counts.turns)

    def _turn_done(self, entry: _Live, out: TurnOutput) -> None:
        t = entry.trajectory
        t.add_turn(out.token_ids, out.logprobs, out.hit_length)
        text = self.generator.decode(out.token_ids)
        action = self.action_decode(out.token_ids) if self.action_decode else text
        t.turn_messages.append(len(t.messages))
        t.messages.append({"role": "assistant", "content": text})
        self._call(entry, TURNS, call_env, entry.env.step, action, loop=entry.loop)

    def _stepped(self, entry: _Live, future: cf.Future, timed_out: bool) -> None:
        t = entry.trajectory
        counts = t.counts
        if timed_out:
            counts.env_timeouts += 1
            t.turn_rewards.append(0.0)
            t.finish(truncated=True)
            return
        try:
            result = StepResult.of(future.result())
        except Exception:  # the model's action broke the environment: counted, trajectory ends
            counts.env_errors += 1
            t.turn_rewards.append(0.0)
            t.finish(truncated=True)
            return
        t.turn_rewards.append(result.reward)
        if result.postprocessed_action is not None:
            self._shorten(t, result.postprocessed_action)
        for key in TOOL_COUNTERS:
            value = result.metadata.get(key)
            if isinstance(value, (int, float)):
                setattr(counts, key, getattr(counts, key) + int(value))
        if result.done:
            t.finish()
            return
        if not t.wants_another_turn():
            return
        closed = self.renderer.closes_turn(t.turns[-1])
        try:
            obs = self.renderer.observation(result.observations, closed, self.limits.max_observation_tokens)
        except ObservationTooLong:  # what the turn asked for (dozens of tool calls) cannot be shown: it ends here
            counts.observations_too_long += 1
            t.finish(truncated=True)
            return
        if not t.add_observation(obs.ids, obs.truncated):
            return
        t.counts.closing_tokens_added += int(obs.closing_added)
        t.messages.extend(obs.messages)
        if t.wants_another_turn():
            self._next_turn(entry)

    def _shorten(self, t: Trajectory, action: str) -> None:
        """skyrl-gym's postprocessed_action: the environment used only this much of the turn (e.g.
        up to its closing tag). The turn's tokens are cut to the shortest prefix that decodes to it
        (found by bisection: a longer prefix of a prefix-matching one matches too) -- unless what
        would go is only whitespace or special tokens (the end-of-turn token stays the model's). An
        action that is no prefix of the turn leaves the tokens as generated: the context must hold
        what the engine generated."""
        turn = t.turns[-1]
        decode = self.generator.decode
        if not decode(turn).startswith(action) or not decode(turn)[len(action) :].strip():
            return
        lo, hi = 0, len(turn)  # decode(turn[:hi]) starts with the action
        while lo < hi:
            mid = (lo + hi) // 2
            if decode(turn[:mid]).startswith(action):
                hi = mid
            else:
                lo = mid + 1
        t.shorten_last_turn(hi)
        t.messages[-1] = {"role": "assistant", "content": decode(turn[:hi])}

    def _check(self, t: Trajectory) -> None:
        if self.check == "off" or not t.turns:  # (a trajectory whose environment never started has no turn)
            return
        actual = t.context()
        try:
            ok, expected = self.renderer.matches_template(t.messages, t.turns, actual, t.turn_messages)
            why = ""
        except Exception as e:  # a template that cannot render the conversation back
            ok, expected, why = False, [], f" ({type(e).__name__}: {e})"
        if ok:
            return
        t.counts.tokenization_mismatches += 1
        at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
        # Inside the prompt no turn of the model's is involved: the prompt is not what the observations continue.
        in_prompt = at < len(t.prompt_ids)
        where = (
            (
                ", inside the prompt: the prompt was not chat-templated as the observations are (data.chat_template=false, "
                "raw-text prompts, or other template options)"
            )
            if in_prompt
            else ""
        )
        message = (
            f"sample {t.index}: the context differs from the chat template's rendering of its conversation at "
            f"token {at} of {len(actual)}{where} (template: {expected[at : at + 8]}, context: {actual[at : at + 8]}){why}"
        )
        if in_prompt:
            message += "; set env.observation_format=plain or chat-template the prompts"
        if self.check == "strict":
            raise TokenizationMismatch(
                message
                if in_prompt
                else (
                    message + "; a template that rewrites earlier turns (e.g. drops reasoning) cannot be "
                    "prefix-exact: set env.tokenization_sanity_check_mode=warn to train anyway"
                )
            )
        if not self._warned:
            self._warned = True
            logger.warning("%s (counted in env/tokenization_mismatches; reported once)", message)

    # ------------------------------------------------------------------ closing: env.get_metrics + env.close
    def _wind_down(self, entry: _Live) -> None:
        if entry.env is None:  # env.make never returned: nothing to close
            entry.phase = CLOSED
            return
        self._call(entry, CLOSING, self._metrics_and_close, entry)

    def _metrics_and_close(self, entry: _Live) -> None:
        """(On the closing thread.) skyrl-gym's episode metrics (optional), then `close` (optional for a
        user's class); neither costs the trajectory anything when it fails."""
        t, env = entry.trajectory, entry.env
        if entry.opening is not None:  # (an init given up may still be running: close after it, not beside it)
            cf.wait([entry.opening], timeout=max(0.0, entry.deadline - time.monotonic()))
        loop = None if entry.abandoned else entry.loop  # (an abandoned call may still run on its loop)
        get_metrics = getattr(env, "get_metrics", None)
        if callable(get_metrics):
            try:
                t.env_metrics = (env_class_key(type(env)), _plain(call_env(get_metrics, loop=loop) or {}))
            except Exception as e:  # metrics never cost a trajectory
                logger.warning(
                    "sample %d: %s.get_metrics() raised %s: %s", t.index, type(env).__name__, type(e).__name__, e
                )
        try:
            call_env(getattr(env, "close", lambda: None), loop=loop)
        except Exception:  # a failing close loses nothing of the trajectory
            pass

    def _closed(self, entry: _Live, future: cf.Future, timed_out: bool) -> None:
        if timed_out:
            entry.trajectory.counts.close_timeouts += 1
            logger.warning(
                "sample %d: %s.get_metrics()/close() ran past %gs: given up",
                entry.trajectory.index,
                type(entry.env).__name__,
                self.step_timeout_s,
            )
        if entry.loop is not None and not entry.abandoned:
            entry.loop.close()
        entry.phase = CLOSED

    def _close_all(self, entries: list[_Live]) -> None:
        """The rollout failed with these trajectories live: give up what they were running, close each
        environment, all within one deadline."""
        for entry in entries:
            if entry.future is not None and entry.phase != CLOSING:
                entry.abandoned = abandonable.abandon(entry.future) or not entry.future.done()
                entry.future = None
            if entry.phase != CLOSING:
                self._wind_down(entry)
        closing = [e for e in entries if e.future is not None]
        if closing:
            cf.wait([e.future for e in closing], timeout=max(0.0, max(e.deadline for e in closing) - time.monotonic()))
        for entry in closing:
            self._after_call(entry)
