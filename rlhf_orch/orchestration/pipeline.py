"""The `pipeline` group: when a step's rollout is generated, relative to the weights that train on it.

* `SyncPipeline` (`pipeline=sync`): generate with the newest weights, hand over, train, sync --
  strictly one after the other; every rollout is on-policy (staleness 0).
* `OneStepOffPipeline` (`pipeline=one_step_off`): while the trainers train on step k's rollout,
  the engines already generate step k+1's with the weights they hold (one version behind). The
  weights move between two generations, never during one:

      step k:  wait for rollout k -> hand it over -> push v(k-1) -> start rollout k+1 (engines, v(k-1))
                                                                  train on rollout k (trainers, v(k-1) -> v(k))

  Rollout k was drawn with v(k-2) while the trainers made v(k-1): every update trains on samples
  one version older than the trainers' weights, except the first (drawn with the initial weights
  right away). Every sample carries the version that drew it; the loop logs
  `rollout/staleness_max` (the trainers' version minus the drawing version).
  The engines' own log-probs are the behaviour policy: `algo.tis_cap` corrects the update with
  truncated importance sampling (`rlhf_orch.algo.losses.truncated_is_weights`).

* `AsyncPipeline` (`pipeline=async`, `pipeline.max_staleness` = eta): the engines run up to
  eta + 1 rollouts ahead of the trainers, several at once (continuous batching across rollouts:
  the long tail of one fills with the next's requests). Step j's rollout starts only once the
  engines hold version j - 1 - eta (AReaL's bound): no sequence trains on weights more than eta
  versions newer than those that drew its first token. eta = 0 is the sync pipeline, step for
  step. Each new version goes to the engines as soon as the trainers made it: with
  `pipeline.partial_rollout=true` it lands between two engine steps and the sequences in flight
  go on with it (`rollout/interrupted` counts them; vLLM labels each token with the version that
  drew it: `rollout/token_staleness_mean`; each token's engine log-prob is that of its weights),
  with `false` the update waits until they finish (every sequence from one version; the
  trainers wait for the tail). Correct the staleness with `algo.decoupled_is_cap` or `algo.tis_cap`.

The loop asks a pipeline three things (`rollout`, `after_train`, `settle`); it never checks which
one it has. `settle` brings the rollouts in flight to rest (before an evaluation, a checkpoint or
the end of the run) so nothing generated is lost: a checkpoint carries them (`pending`), a resume
puts them back (`restore`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # names for annotations only: the config checks read these classes without torch
    from rlhf_orch.transfer.base import Delivery, HeldRollout, RolloutTransfer, Route


class PipelineHost(Protocol):
    """What a pipeline asks of the train loop (`rlhf_orch.orchestration.loop.TrainLoop`), which
    owns the pipeline: the pipeline decides when, the loop knows how."""

    transfer: RolloutTransfer
    settings: Any  # LoopSettings: num_steps
    closing: bool  # set when the run ends: a generation still running must not replace engines

    def rollout_request(self, step: int) -> Any: ...
    def route(self, step: int | None = None) -> Route: ...
    def generate(self, step: int) -> HeldRollout: ...
    def make_rollout(self, request: Any, route: Route) -> HeldRollout: ...
    def hand_over(self, held: HeldRollout) -> Delivery: ...
    def export_held(self, held: HeldRollout) -> HeldRollout: ...
    def sync_engines(self, timings: dict[str, float]) -> None: ...
    def sleep_engines(self) -> None: ...


class RolloutPipeline:
    # Oldest rollout (in weight versions behind the trainers) this pipeline ever trains on.
    max_staleness: ClassVar[int] = 0
    # Needs a transfer that can hold a finished rollout until the trainers are free.
    needs_held_rollouts: ClassVar[bool] = False
    # (the memory plan asks) Engines generate while the trainers train, so a colocated engine is
    # awake then; and whether idle engines are ever put to sleep (engine.sleep_level).
    engines_awake_in_training: ClassVar[bool] = False
    sleeps_engines: ClassVar[bool] = True
    # Rollouts an engine generates at once (its Ray max_concurrency; > 1: continuous batching across them).
    rollouts_at_once: int = 1
    # Every sample of a rollout is drawn by one weight version (the loop's exactness under faults:
    # an engine replaced mid-rollout must get that version, or the run restarts from its checkpoint).
    one_version_per_rollout: ClassVar[bool] = True
    # A weight update waits until the requests in flight finish (the engines hold it back; the
    # driver waits for that before it pushes: `EngineFleet._push`).
    finishes_requests_before_update: bool = False
    # A share of a held rollout lost with its engine is drawn again on the replacement (the same
    # prompts, new samples) instead of restarting the run from its checkpoint, which would repeat
    # the uninterrupted run exactly: for pipelines whose sampling depends on timing anyway (async).
    redraws_lost_shares: ClassVar[bool] = False

    def rollout(self, loop: PipelineHost, step: int, timings: dict[str, float]) -> Delivery:
        """Step `step`'s rollout, staged on the trainer ranks."""
        if loop.transfer.holds_rollouts:  # (checked between the two: every share still held)
            return loop.hand_over(loop.generate(step))
        return loop.transfer.deliver(loop.rollout_request(step), loop.route(step))

    def engines_idle(self, loop: PipelineHost) -> None:
        """The rollout is on the trainers: the engines have nothing to do until the sync."""
        loop.sleep_engines()

    def after_train(self, loop: PipelineHost, timings: dict[str, float]) -> None:
        """The trainers finished an update: the engines take the new weights now."""
        loop.sync_engines(timings)

    def overlap_s(self, train_start: float, train_end: float) -> float | None:
        """Seconds the engines generated while the trainers were busy (perf_counter times); None
        when this pipeline never overlaps them."""
        return None

    def settle(self, loop: PipelineHost) -> HeldRollout | None:
        """Wait for a rollout in flight (none here); the engines hold the newest weights after."""
        loop.sync_engines({})
        return None

    def pending(self, loop: PipelineHost) -> HeldRollout | None:
        """The rollout generated for the next step, with its samples (for a checkpoint), or None."""
        return None

    def holds_rollout(self) -> bool:
        """A rollout generated ahead is held (on the engines, with packed transfer) or in flight."""
        return False

    def restore(self, loop: PipelineHost, held: HeldRollout | None) -> None:
        """A resumed checkpoint's pending rollout: put it back where `rollout` expects it."""
        if held is not None:
            raise ValueError(
                f"{type(self).__name__} does not hold rollouts between steps, but the checkpoint carries one"
            )

    def close(self, loop: PipelineHost | None, wait: bool = False) -> None:
        """The run ends (normally or not): nothing more is generated. `wait`: return only once no
        generation of this run is running (its engines are kept for another run)."""

    def holds_finished_rollouts(self) -> bool:
        """A rollout for a later step is finished and held on the engines (an engine lost now
        takes its share with it: the run restarts from its checkpoint instead)."""
        return False

    def engine_idle_s(self, start: float, end: float) -> float | None:
        """Seconds between `start` and `end` (perf_counter) with no generation in flight; None
        when the engines generate only inside a step (the step minus `generate`)."""
        return None

    def metrics(self, delivery: Delivery, trained: int) -> dict[str, float]:
        """This pipeline's own metrics of the step whose rollout `delivery` is, trained on by the
        trainers' version `trained` - 1."""
        return {}


class SyncPipeline(RolloutPipeline):
    """Generate, hand over, train, sync: on-policy, nothing overlaps."""


class OneStepOffPipeline(RolloutPipeline):
    """Generate step k+1's rollout while the trainers train on step k's (one weight version behind)."""

    max_staleness: ClassVar[int] = 1
    needs_held_rollouts: ClassVar[bool] = True
    engines_awake_in_training: ClassVar[bool] = True  # the next rollout generates meanwhile; sleeps after it

    def __init__(self) -> None:
        # One background thread drives the next rollout's generation (its Ray calls, dynamic
        # sampling rounds, engine replacement); the main thread drives the trainers.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._next: concurrent.futures.Future | None = None
        self._held: HeldRollout | None = None  # settled or restored, not handed over yet
        self._gen_start: float | None = None  # perf_counter span of the last background generation
        self._gen_end: float | None = None

    def rollout(self, loop: PipelineHost, step: int, timings: dict[str, float]) -> Delivery:
        t = time.perf_counter()
        held = self._take(loop, step)
        timings["rollout_wait"] = time.perf_counter() - t  # generation the trainers could not hide
        delivery = loop.hand_over(held)
        # The engines are idle now: give them the trainers' newest weights, then start the next
        # rollout, which runs while the trainers train on this one.
        loop.sync_engines(timings)
        if step < loop.settings.num_steps:
            self._start(loop, step + 1)
        return delivery

    def engines_idle(self, loop: PipelineHost) -> None:
        """Not now: the engines are generating the next rollout (they sleep when it is done)."""

    def after_train(self, loop: PipelineHost, timings: dict[str, float]) -> None:
        """Nothing: the weights move once the rollout in flight is done (next step, or `settle`)."""

    def overlap_s(self, train_start: float, train_end: float) -> float:
        """Seconds the engines generated while the trainers were busy (perf_counter times)."""
        if self._gen_start is None:
            return 0.0
        gen_end = self._gen_end if self._gen_end is not None else time.perf_counter()  # still generating
        return max(min(gen_end, train_end) - max(self._gen_start, train_start), 0.0)

    def settle(self, loop: PipelineHost) -> HeldRollout | None:
        if self._next is not None:
            self._held = self._next.result()
            self._next = None
        loop.sync_engines({})
        return self._held

    def pending(self, loop: PipelineHost) -> HeldRollout | None:
        held = self.settle(loop)
        if held is None:
            return None
        return loop.export_held(held)

    def holds_rollout(self) -> bool:
        return self._held is not None or self._next is not None

    def restore(self, loop: PipelineHost, held: HeldRollout | None) -> None:
        self._held = loop.transfer.import_held(held, loop.route()) if held is not None else None

    def close(self, loop: PipelineHost | None, wait: bool = False) -> None:
        # A generation still running ends when its engines are killed; it must not replace them
        # (`wait`: the engines stay for another run, so the generation ends first).
        if loop is not None:
            loop.closing = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    # ------------------------------------------------------------------ pieces
    def _take(self, loop: PipelineHost, step: int) -> HeldRollout:
        if self._next is not None:
            self._held, self._next = self._next.result(), None
        held, self._held = self._held, None
        if held is None:  # the first step: nothing was generated ahead, generate with v0 now
            return loop.generate(step)
        if held.step != step:
            raise RuntimeError(f"the rollout generated ahead was for step {held.step}, not {step}")
        return held

    def _start(self, loop: PipelineHost, step: int) -> None:
        self._next_step = step

        self._gen_start, self._gen_end = time.perf_counter(), None

        def generate() -> HeldRollout:
            try:
                held = loop.generate(step)
            finally:
                self._gen_end = time.perf_counter()
            loop.sleep_engines()  # idle until the next step's sync
            return held

        self._next = self._pool.submit(generate)


class AsyncPipeline(RolloutPipeline):
    """Up to max_staleness + 1 rollouts generate ahead of the trainers, at once on every engine;
    each new version reaches the engines as soon as the trainers made it."""

    needs_held_rollouts: ClassVar[bool] = True
    engines_awake_in_training: ClassVar[bool] = True  # never idle (engines_idle does nothing), never asleep
    sleeps_engines: ClassVar[bool] = False
    one_version_per_rollout: ClassVar[bool] = False  # each new version reaches the rollouts in flight
    redraws_lost_shares: ClassVar[bool] = (
        True  # an engine lost costs its shares, not the run (sampling is timing-dependent anyway)
    )

    def __init__(self, max_staleness: int, partial_rollout: bool = True) -> None:
        if max_staleness < 0:
            raise ValueError(f"pipeline.max_staleness={max_staleness} must be >= 0")
        self.max_staleness = max_staleness  # the class's bound for this instance (the loop reads it)
        self.partial_rollout = partial_rollout
        self.finishes_requests_before_update = not partial_rollout
        self.rollouts_at_once = max_staleness + 1
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_staleness + 1, thread_name_prefix="rollout")
        self._in_flight: dict[int, concurrent.futures.Future] = {}  # step -> its generation
        self._ready: dict[int, HeldRollout] = {}  # settled or restored, not handed over yet
        self._next: int | None = None  # the next step whose rollout has not started
        self._handing: int | None = None  # the step whose finished rollout is being handed over
        self._lock = threading.Lock()
        self._busy: list[list[float]] = []  # perf_counter spans with a generation in flight ([start, end])
        self._running = 0
        self._buffer_ready = 0

    # ------------------------------------------------------------------ the loop's calls
    def rollout(self, loop: PipelineHost, step: int, timings: dict[str, float]) -> Delivery:
        self._start_allowed(loop, step)
        t = time.perf_counter()
        held = self._take(step)
        timings["rollout_wait"] = time.perf_counter() - t  # the trainers idle, waiting for this rollout
        self._buffer_ready = sum(f.done() for f in self._in_flight.values()) + len(self._ready)
        try:
            return loop.hand_over(held)
        finally:
            with self._lock:
                self._handing = None

    def engines_idle(self, loop: PipelineHost) -> None:
        """Never: the engines go on with the next rollouts."""

    def after_train(self, loop: PipelineHost, timings: dict[str, float]) -> None:
        """The new version goes to the engines now, into the generations in flight; the rollouts
        it allows start."""
        loop.sync_engines(timings)
        self._start_allowed(loop, None)

    def overlap_s(self, train_start: float, train_end: float) -> float:
        with self._lock:
            spans = [(a, b if b is not None else train_end) for a, b in self._busy]
        return sum(max(min(b, train_end) - max(a, train_start), 0.0) for a, b in spans)

    def engine_idle_s(self, start: float, end: float) -> float:
        return max(end - start - self.overlap_s(start, end), 0.0)

    def settle(self, loop: PipelineHost) -> list[HeldRollout] | None:
        for step in sorted(self._in_flight):
            held = self._in_flight[step].result()  # (still counted in flight while it finishes)
            with self._lock:
                self._ready[step] = held
                del self._in_flight[step]
        loop.sync_engines({})
        return [self._ready[s] for s in sorted(self._ready)] or None

    def pending(self, loop: PipelineHost) -> list[HeldRollout] | None:
        held = self.settle(loop)
        if not held:
            return None
        return [loop.export_held(h) for h in held]

    def holds_rollout(self) -> bool:
        with self._lock:  # (asked from rollout threads too)
            return bool(self._ready or self._in_flight)

    def holds_finished_rollouts(self) -> bool:
        with self._lock:  # (asked from rollout threads, which replace engines, while this thread moves rollouts)
            return bool(self._ready) or self._handing is not None or any(f.done() for f in self._in_flight.values())

    def restore(self, loop: PipelineHost, held: Any) -> None:
        if held is None:
            return
        rollouts = held if isinstance(held, list) else [held]  # (a one_step_off checkpoint holds one)
        for h in rollouts:
            self._ready[h.step] = loop.transfer.import_held(h, loop.route())
        self._next = max(self._ready) + 1

    def close(self, loop: PipelineHost | None, wait: bool = False) -> None:
        # Generations still running end when their engines are killed; they must not replace them
        # (`wait`: the engines stay for another run, so the generations end first).
        if loop is not None:
            loop.closing = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def metrics(self, delivery: Delivery, trained: int) -> dict[str, float]:
        meta = delivery.meta
        metrics = {
            "async/buffer_ready": self._buffer_ready,  # rollouts finished ahead when this one was taken
            "rollout/interrupted": meta.interrupted_count,
        }
        if self.partial_rollout and self.max_staleness and meta.token_version_means:
            # Per token (a sequence a weight update reached mid-way is partly newer): the tokens'
            # staleness averaged over every response token of the step (the max is the oldest
            # token's, rollout/staleness_max).
            behind = sum((trained - 1 - v) * n for v, n in zip(meta.token_version_means, meta.response_lens))
            metrics["rollout/token_staleness_mean"] = behind / max(sum(meta.response_lens), 1)
        return metrics

    # ------------------------------------------------------------------ pieces
    def _start_allowed(self, loop: PipelineHost, step: int | None) -> None:
        """Start every rollout the staleness bound allows now: step j once the engines hold
        version j - 1 - max_staleness (or newer), up to the last step. Started in step order on
        this thread: the prompts are drawn and the engines seeded as in the sync pipeline."""
        if self._next is None:
            if step is None:
                return
            self._next = step
        last = min(loop.settings.num_steps, loop.version + 1 + self.max_staleness)
        while self._next <= last:
            j = self._next
            request = loop.rollout_request(j)
            request.slot = j
            future = self._pool.submit(self._generate, loop, request, loop.route(j), j)
            with self._lock:
                self._in_flight[j] = future
            self._next += 1

    def _generate(self, loop: PipelineHost, request: Any, route: Route, step: int) -> HeldRollout:
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._busy.append([time.perf_counter(), None])
        try:
            held = loop.make_rollout(request, route)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._busy[-1][1] = time.perf_counter()
                    self._busy = self._busy[-64:]  # the spans a step can still ask about
        held.step = step
        return held

    def _take(self, step: int) -> HeldRollout:
        with self._lock:
            if step in self._ready:
                self._handing = step
                return self._ready.pop(step)
            future = self._in_flight.get(step)
        if future is None:
            raise RuntimeError(f"no rollout was started for step {step}")
        held = future.result()  # (counted in flight until it is taken: an engine lost meanwhile restarts the run)
        with self._lock:
            del self._in_flight[step]
            self._handing = step  # finished and held on the engines until the hand-over returns
        return held
