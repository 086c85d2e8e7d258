"""Drive many multi-turn trajectories through one engine at once.

Trajectories progress independently: while one waits for its environment (a tool running in the
step pool), the engine keeps generating the others' turns; a batch ends when every trajectory is
done or hit a limit. At most `concurrency` trajectories are in flight; the rest wait to start.

The engine side is a `TurnGenerator` (the vLLM engine supplies one; tests a scripted one), so this
module is pure: no vLLM, no Ray.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import StepResult, TextEnv, prompt_messages
from rlhf_orch.env.trajectory import Trajectory, TrajectoryLimits

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


class EnvRuntimeError(RuntimeError):
    """An environment could not be built or initialised for a row (a bug in it or in the data)."""


@dataclass
class _Live:
    trajectory: Trajectory
    env: TextEnv
    future: cf.Future | None = None
    deadline: float = 0.0
    started: float = 0.0


class MultiTurnRunner:
    def __init__(
        self,
        make_env: Callable[[Prompt], TextEnv],
        generator: TurnGenerator,
        render: Callable[[Sequence[dict]], list[int]],
        limits: TrajectoryLimits,
        concurrency: int,
        step_timeout_s: float,
        render_prompt: Callable[[list[dict]], list[int]] | None = None,
    ):
        self.make_env = make_env
        self.generator = generator
        self.render = render
        self.render_prompt = render_prompt
        self.limits = limits
        self.concurrency = concurrency
        self.step_timeout_s = step_timeout_s

    def run(self, items: Sequence[tuple[int, Prompt, Sequence[int]]]) -> Iterator[Trajectory]:
        """Every (sample index, prompt, prompt ids) as a trajectory; yields each as it finishes."""
        waiting = deque(items)
        live: dict[int, _Live] = {}
        pool = cf.ThreadPoolExecutor(max_workers=max(1, self.concurrency), thread_name_prefix="env-step")
        try:
            while waiting or live:
                while waiting and len(live) < self.concurrency:
                    index, prompt, ids = waiting.popleft()
                    entry = self._start(index, prompt, ids)
                    live[index] = entry
                    self._next_turn(entry)
                for out in self.generator.poll() if self.generator.busy() else ():
                    entry = live[out.key]
                    entry.trajectory.add_turn(out.token_ids, out.logprobs, out.hit_length)
                    action = self.generator.decode(out.token_ids)
                    entry.started = time.perf_counter()
                    entry.deadline = time.monotonic() + self.step_timeout_s
                    entry.future = pool.submit(entry.env.step, action)
                for entry in self._stepped(live, block=not self.generator.busy()):
                    self._after_step(entry)
                finished = [i for i, e in live.items() if e.trajectory.done]
                for index in finished:
                    yield self._close(live.pop(index))
                if live and not finished and not self.generator.busy() and all(e.future is None for e in live.values()):
                    raise RuntimeError(f"multi-turn rollout stalled: {len(live)} trajectories neither generating nor stepping")
        finally:
            for entry in live.values():
                self._close(entry)
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ pieces
    def _start(self, index: int, prompt: Prompt, ids: Sequence[int]) -> _Live:
        t = time.perf_counter()
        try:
            env = self.make_env(prompt)
            messages = prompt_messages(prompt)
            first, _ = env.init(messages)
        except Exception as e:  # noqa: BLE001 - named in one line for the driver
            raise EnvRuntimeError(f"the environment for sample {index} could not start: {type(e).__name__}: {e}") from e
        prompt_ids = list(ids)
        if first is not None and list(first) != messages and self.render_prompt is not None:
            prompt_ids = self.render_prompt(list(first))  # the environment rewrote the prompt
        trajectory = Trajectory(index, prompt_ids, self.limits)
        trajectory.counts.env_seconds += time.perf_counter() - t
        return _Live(trajectory, env)

    def _next_turn(self, entry: _Live) -> None:
        t = entry.trajectory
        self.generator.submit(t.index, t.context(), t.next_turn_budget(), t.counts.turns)

    def _stepped(self, live: dict[int, _Live], block: bool) -> list[_Live]:
        """Entries whose env.step finished or timed out; waits for one when the engine is idle."""
        pending = {e.future: e for e in live.values() if e.future is not None}
        if not pending:
            return []
        timeout = 0.0
        if block:
            timeout = max(0.0, min(e.deadline for e in pending.values()) - time.monotonic())
        done, _ = cf.wait(list(pending), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        now = time.monotonic()
        return [e for f, e in pending.items() if f in done or now >= e.deadline]

    def _after_step(self, entry: _Live) -> None:
        t, future = entry.trajectory, entry.future
        entry.future = None
        counts = t.counts
        counts.env_seconds += time.perf_counter() - entry.started
        if not future.done():  # past env.tool_timeout_s: its thread is left to finish on its own
            counts.env_timeouts += 1
            t.turn_rewards.append(0.0)
            t.finish(truncated=True)
            return
        try:
            result = StepResult.of(future.result())
        except Exception:  # noqa: BLE001 - the model's action broke the environment: counted, trajectory ends
            counts.env_errors += 1
            t.turn_rewards.append(0.0)
            t.finish(truncated=True)
            return
        t.turn_rewards.append(result.reward)
        for key in TOOL_COUNTERS:
            value = result.metadata.get(key)
            if isinstance(value, (int, float)):
                setattr(counts, key, getattr(counts, key) + int(value))
        if result.done:
            t.finish()
            return
        if not t.wants_another_turn():
            return
        if t.add_observation(self.render(result.observations)) and t.wants_another_turn():
            self._next_turn(entry)

    def _close(self, entry: _Live) -> Trajectory:
        t = entry.trajectory
        try:
            getattr(entry.env, "close", lambda: None)()  # optional for a user's class
        except Exception:  # noqa: BLE001 - a failing close loses nothing of the trajectory
            pass
        return t
