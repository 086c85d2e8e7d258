"""Liveness by progress, not wall time: a wait on actors that keep moving is never cut; one on
actors that stopped is given up within two windows.

Every process a step waits on counts what it gets done and answers `progress()` -- that count --
on a thread of its own (the concurrency group `MONITOR`), beside the call that keeps its main
thread busy: a vLLM engine counts engine steps and scored samples (`VLLMEngine.progress`), a
trainer rank micro-batches, decoder layers, the tensors an update saves for its backward and
collectives entered and left (`rlhf_orch.trainer.progress`). A wait looks every `window_s` (fault.step_timeout_s) without the
results it waits for: a count that moved since the last look is progress, one that stands (or
does not answer within `ANSWER_S`) is not; a first look counts as progress. So a stuck process is
found within two windows (plus the answer's wait), however long its healthy calls run.

Two kinds of waits (`ProgressWatch.together`):

* independent actors (the engines of a rollout): each must move; a stuck one is named while the
  others still make steps.
* actors that wait on each other (the ranks of one trainer phase: their collectives, and a policy
  rank's experience call waiting for the reference's and the critic's results, `Deferred`): the
  phase moves while any of them does -- a rank waiting in an all-reduce for a slower peer makes
  no count of its own meanwhile.

Pure logic: the look at the counts (`read`) and the wait on results (`wait`) are injected; the
defaults ask Ray.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence, TypeVar

import ray

T = TypeVar("T")

MONITOR = "monitor"  # the concurrency group of `progress` on every engine and trainer actor class
ANSWER_S = 10.0  # how long a look waits for the counts (a process that does not answer is stuck)


def actor_class(cls: type) -> Any:
    """`cls` as a Ray actor class whose `progress` (declared in `MONITOR`) answers on a thread of its
    own while a call runs. Its other methods then run on one thread that is not the process's main
    thread (Ray's default group of a threaded actor), one call at a time."""
    return ray.remote(concurrency_groups={MONITOR: 1})(cls)


@dataclass(frozen=True)
class Deferred:
    """An object ref handed to an actor call unresolved. Ray resolves a call's top-level refs before
    it starts and, calls of one caller to one actor running in submission order, holds every later
    call of that caller to it -- `progress` included, whatever its concurrency group -- until they
    are: a rank waiting for a slow peer's result would not answer. Wrapped in this, the call starts
    at once and fetches the value itself (`resolved`)."""

    ref: Any


def deferred(value: Any) -> Any:
    """`value` as a `Deferred` when it is an object ref, else as it is."""
    return Deferred(value) if isinstance(value, ray.ObjectRef) else value


def resolved(value: Any) -> Any:
    """(Inside the actor.) The value a `Deferred` stands for; anything else as it is."""
    return ray.get(value.ref) if isinstance(value, Deferred) else value


class WorkCount:
    """What a process got done: a count that only grows, what its `progress` answers. Written by
    its working threads (a trainer's autograd thread too; an engine's scoring threads under
    pipeline=async), read by the monitor thread; the lock keeps every increment."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def tick(self, *_: Any) -> None:
        """One more unit of work done (arguments ignored: usable as a hook)."""
        with self._lock:
            self.count += 1

    def each(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, each counted as done when the loop asks for the next (and after the last)."""
        for item in items:
            yield item
            self.tick()

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Counted at entry and at exit: a process that never leaves stands at its entry's count."""
        self.tick()
        try:
            yield
        finally:
            self.tick()


def has_method(actor: Any, name: str) -> bool:
    """Whether a Ray actor handle (or a plain object in tests) offers `name`."""
    try:
        getattr(actor, name)
    except AttributeError:
        return False
    return True


def ask_progress(actors: Mapping[Hashable, Any]) -> dict[Hashable, ray.ObjectRef]:
    """Ask every actor (key -> handle) that has a count for it (`progress`, answered on a thread of
    its own beside a running call)."""
    return {k: actor.progress.remote() for k, actor in actors.items() if has_method(actor, "progress")}


def read_progress(asks: Mapping[Hashable, ray.ObjectRef], timeout_s: float) -> dict[Hashable, int | None]:
    """The answers to `ask_progress` within `timeout_s` (together): None for one that did not
    answer in time or whose actor died."""
    counts: dict[Hashable, int | None] = dict.fromkeys(asks)
    if asks:
        done, _ = ray.wait(list(asks.values()), num_returns=len(asks), timeout=timeout_s)
        for k, ref in asks.items():
            if ref in done:
                try:
                    counts[k] = ray.get(ref)
                except ray.exceptions.RayError:
                    pass
    return counts


@dataclass
class ProgressWatch:
    """Waits on actors' results, looking at their counts every `window_s` without one."""

    window_s: float
    # The actors wait on each other (one phase's ranks): none is stuck while any of them moves.
    together: bool = False
    # read(actors) -> count by key now (None: no answer, no count); default: `progress` over Ray.
    read: Callable[[Mapping[Hashable, Any]], Mapping[Hashable, int | None]] | None = None
    wait: Callable[..., tuple[list, list]] = ray.wait  # ray.wait's signature (tests: a fake clock)
    # key -> (its handle, its count) at the last look; another handle (a replacement) starts afresh
    seen: dict[Hashable, tuple[Any, int]] = field(default_factory=dict)
    stalled: list[Hashable] = field(default_factory=list)  # who the last look found stuck

    def stood(self, actors: Mapping[Hashable, Any]) -> list[Hashable]:
        """Of `actors` (key -> handle), the stuck ones by this look: their count stood since the
        last look (or they gave none); every key when `together` and none moved, else none."""
        counts = (
            self.read(actors)
            if self.read is not None
            else read_progress(ask_progress(actors), min(ANSWER_S, self.window_s))
        )
        counts = {k: counts.get(k) for k in actors}
        stood = [k for k, c in counts.items() if c is None or self.seen.get(k) == (actors[k], c)]
        self.seen.update({k: (actors[k], c) for k, c in counts.items() if c is not None})
        if self.together and len(stood) < len(counts):
            return []
        return stood

    def first_ready(self, waiting: Sequence[Any], actors: Mapping[Hashable, Any]) -> list[Any]:
        """The first of `waiting` (Ray refs or streaming generators) that is ready, or [] once a look
        finds `actors` (those that owe them, or that they wait on) stuck (`stalled` names them)."""
        self.stalled = []
        while True:
            ready, _ = self.wait(list(waiting), num_returns=1, timeout=self.window_s)
            if ready:
                return ready
            self.stalled = self.stood(actors)
            if self.stalled:
                return []

    def all_ready(
        self,
        waiting: Sequence[Any],
        actors: Mapping[Hashable, Any],
        on_ready: Callable[[list], Any] = lambda refs: None,
    ) -> bool:
        """Wait until every one of `waiting` is ready (True), or a look finds `actors` stuck (False;
        `stalled` names them). `on_ready(refs)` sees each as it comes (the caller's `ray.get`, so an
        actor's failure is raised at once, not after its peers wait for it)."""
        pending = list(waiting)
        while pending:
            ready = self.first_ready(pending, actors)
            if not ready:
                return False
            on_ready(ready)
            pending = [r for r in pending if r not in ready]
        return True


def no_progress_note(stalled: Sequence[str], window_s: float) -> str:
    """The one-line note on the trainer ranks a wait gave up on."""
    return f"{', '.join(stalled)} made no progress within {window_s:g}s (fault.step_timeout_s) or did not answer"
