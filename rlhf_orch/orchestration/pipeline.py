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

The loop asks a pipeline three things (`rollout`, `after_train`, `settle`); it never checks which
one it has. A pipeline holds at most one rollout in flight, and `settle` brings it to rest (before
an evaluation, a checkpoint or the end of the run) so nothing generated is lost: a checkpoint
carries it (`pending`), a resume puts it back (`restore`).
"""

from __future__ import annotations

import concurrent.futures
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
    def sync_engines(self, timings: dict[str, float]) -> None: ...
    def sleep_engines(self) -> None: ...


class RolloutPipeline:
    # Oldest rollout (in weight versions behind the trainers) this pipeline ever trains on.
    max_staleness: ClassVar[int] = 0
    # Needs a transfer that can hold a finished rollout until the trainers are free.
    needs_held_rollouts: ClassVar[bool] = False

    def rollout(self, loop: PipelineHost, step: int, timings: dict[str, float]) -> Delivery:
        """Step `step`'s rollout, staged on the trainer ranks."""
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
            raise ValueError(f"{type(self).__name__} does not hold rollouts between steps, but the checkpoint carries one")

    def close(self, loop: PipelineHost | None) -> None:
        """The run ends (normally or not): nothing more is generated."""


class SyncPipeline(RolloutPipeline):
    """Generate, hand over, train, sync: on-policy, nothing overlaps."""


class OneStepOffPipeline(RolloutPipeline):
    """Generate step k+1's rollout while the trainers train on step k's (one weight version behind)."""

    max_staleness: ClassVar[int] = 1
    needs_held_rollouts: ClassVar[bool] = True

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
        delivery = loop.transfer.hand_over(held, loop.route())
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
        return loop.transfer.export_held(held, loop.route())

    def holds_rollout(self) -> bool:
        return self._held is not None or self._next is not None

    def restore(self, loop: PipelineHost, held: HeldRollout | None) -> None:
        self._held = loop.transfer.import_held(held, loop.route()) if held is not None else None

    def close(self, loop: PipelineHost | None) -> None:
        # A generation still running ends when its engines are killed; it must not replace them.
        if loop is not None:
            loop.closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)

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
