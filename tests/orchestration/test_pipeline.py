"""The `pipeline` group's contract, without Ray: a fake loop records what happens when.

`sync` generates every rollout with the newest weights; `one_step_off` generates step k+1's
rollout while the trainers train on step k's, so no rollout is older than one version, the first
is drawn with the initial weights, every rollout is handed over exactly once, weights never move
during a generation, and a checkpoint taken mid-overlap carries the rollout generated ahead."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from rlhf_orch.orchestration.pipeline import AsyncPipeline, OneStepOffPipeline, SyncPipeline
from rlhf_orch.transfer.base import Delivery, HeldRollout
from rlhf_orch.transfer.engine_side import RolloutMeta

SAMPLES = 4


@dataclass
class Settings:
    num_steps: int


class FakeTransfer:
    """Holds rollouts 'on the engines' (a dict) like packed does; export/import copy them out and back."""

    holds_rollouts = True

    def __init__(self, loop: "FakeLoop"):
        self.loop = loop
        self.engine_store: dict[int, list[int]] = {}

    def deliver(self, request, route) -> Delivery:
        return self.hand_over(self.generate(request, route), route)

    def generate(self, step, route) -> HeldRollout:
        loop = self.loop
        with loop.lock:
            loop.events.append(("generate_start", step, loop.version))
            loop.generating += 1
        time.sleep(loop.generate_s)
        version = loop.version  # what the engines hold while generating
        self.engine_store = {step: [version] * SAMPLES}
        with loop.lock:
            loop.generating -= 1
            loop.events.append(("generate_end", step, version))
        meta = RolloutMeta(
            indices=list(range(SAMPLES)),
            seq_lens=[3] * SAMPLES,
            response_lens=[1] * SAMPLES,
            rewards=[0.0] * SAMPLES,
            weight_versions=[version] * SAMPLES,
        )
        return HeldRollout(meta=meta, held=step, num_shards=1, micro_batch_size=1, pad_id=0, max_seq_len=3)

    def hand_over(self, held: HeldRollout, route) -> Delivery:
        versions = self.engine_store.pop(held.held)  # the engines release what they hand over
        assert versions == held.meta.weight_versions
        self.loop.events.append(("hand_over", held.held, versions[0]))
        return Delivery(meta=held.meta, wire_bytes=0, wire_tokens=0)

    def export_held(self, held, route) -> HeldRollout:
        return HeldRollout(**{**held.__dict__, "held": (held.held, list(self.engine_store[held.held]))})

    def import_held(self, held, route) -> HeldRollout:
        step, versions = held.held
        self.engine_store = {**self.engine_store, step: versions}
        return HeldRollout(**{**held.__dict__, "held": step})


@dataclass
class FakeLoop:
    num_steps: int
    generate_s: float = 0.0
    train_s: float = 0.0
    version: int = 0
    trained: int = 0
    closing: bool = False
    events: list = field(default_factory=list)
    generating: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.settings = Settings(self.num_steps)
        self.transfer = FakeTransfer(self)

    def route(self, step=None):
        return None

    def rollout_request(self, step):
        return step

    def generate(self, step) -> HeldRollout:
        held = self.transfer.generate(step, None)
        held.step = step
        return held

    def make_rollout(self, request, route) -> HeldRollout:
        return self.transfer.generate(request, route)

    def hand_over(self, held):
        return self.transfer.hand_over(held, None)

    def export_held(self, held):
        return self.transfer.export_held(held, None)

    def sleep_engines(self):
        with self.lock:
            self.events.append(("sleep", self.version))

    def sync_engines(self, timings):
        if self.version == self.trained:
            return
        with self.lock:
            assert self.generating == 0, "weights moved during a generation"
            self.events.append(("sync", self.trained))
        self.version = self.trained
        timings["sync"] = 0.0

    def step(self, pipeline, step) -> dict:
        """What TrainLoop.step does around the pipeline: rollout, train (an update), after_train."""
        timings: dict[str, float] = {}
        delivery = pipeline.rollout(self, step, timings)
        t = time.perf_counter()
        time.sleep(self.train_s)
        self.trained += 1
        overlap = pipeline.overlap_s(t, time.perf_counter())
        if overlap is not None:
            timings["overlap"] = overlap
        pipeline.after_train(self, timings)
        return {"staleness": [self.trained - 1 - v for v in delivery.meta.weight_versions], **timings}


def _handed_over(loop):
    return [(e[1], e[2]) for e in loop.events if e[0] == "hand_over"]


def test_sync_pipeline_is_on_policy():
    loop, pipeline = FakeLoop(num_steps=4), SyncPipeline()
    rows = [loop.step(pipeline, k) for k in range(1, 5)]
    assert all(r["staleness"] == [0] * SAMPLES for r in rows)
    assert _handed_over(loop) == [(1, 0), (2, 1), (3, 2), (4, 3)]  # step k drawn with v(k-1)
    assert loop.version == 4


def test_one_step_off_is_at_most_one_version_behind_and_hands_over_each_rollout_once():
    loop, pipeline = FakeLoop(num_steps=5, generate_s=0.05, train_s=0.05), OneStepOffPipeline()
    try:
        rows = [loop.step(pipeline, k) for k in range(1, 6)]
    finally:
        pipeline.close(loop)
    assert rows[0]["staleness"] == [0] * SAMPLES  # the first rollout: the initial weights, now
    assert all(r["staleness"] == [1] * SAMPLES for r in rows[1:])
    assert max(max(r["staleness"]) for r in rows) == pipeline.max_staleness
    # Each step's rollout exactly once, in order; step k's drawn with v(k-2) from step 2 on.
    assert _handed_over(loop) == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
    generated = [e[1] for e in loop.events if e[0] == "generate_start"]
    assert generated == [1, 2, 3, 4, 5]  # nothing beyond the last step
    # Generation and training overlapped (the trainers did not wait for the next rollout).
    assert all(r["overlap"] > 0.02 for r in rows[:-1]) and rows[-1]["overlap"] == 0.0


def test_one_step_off_checkpoint_mid_overlap_carries_the_rollout_generated_ahead():
    loop, pipeline = FakeLoop(num_steps=4, generate_s=0.05), OneStepOffPipeline()
    for k in (1, 2):
        loop.step(pipeline, k)
    pending = pipeline.pending(loop)  # waits for step 3's rollout, then reads it off the engines
    assert pending.step == 3 and pending.held == (3, [1] * SAMPLES)
    assert loop.version == loop.trained == 2  # settled: the engines hold the newest weights
    pipeline.close(loop)

    # "Resume": fresh engines (nothing held), the same trainer state; the rollout goes back.
    resumed = FakeLoop(num_steps=4, version=2, trained=2)
    again = OneStepOffPipeline()
    again.restore(resumed, pending)
    rows = [resumed.step(again, k) for k in (3, 4)]
    again.close(resumed)
    assert [e for e in resumed.events if e[0] == "generate_start"] == [("generate_start", 4, 2)]  # 3 was not redrawn
    assert _handed_over(resumed) == [(3, 1), (4, 2)]
    assert [r["staleness"] for r in rows] == [[1] * SAMPLES, [1] * SAMPLES]


def test_one_step_off_refuses_a_rollout_for_another_step():
    loop, pipeline = FakeLoop(num_steps=4), OneStepOffPipeline()
    loop.step(pipeline, 1)
    with pytest.raises(RuntimeError, match="generated ahead was for step 2, not 3"):
        loop.step(pipeline, 3)
    pipeline.close(loop)


def test_sync_pipeline_refuses_a_checkpoint_that_carries_a_rollout():
    with pytest.raises(ValueError, match="does not hold rollouts"):
        SyncPipeline().restore(FakeLoop(num_steps=1), HeldRollout(RolloutMeta([], [], [], []), None, 1, 1, 0, 1))


# --------------------------------------------------------------------------- pipeline=async
class AsyncFakeTransfer(FakeTransfer):
    """Holds any number of rollouts, each in its own slot, like packed does under pipeline=async;
    a rollout's samples carry the version the engines held when it started."""

    def __init__(self, loop: "AsyncFakeLoop"):
        super().__init__(loop)
        self.in_flight_max = 0

    def generate(self, request, route) -> HeldRollout:
        loop, step = self.loop, request.step
        with loop.lock:
            version = loop.version
            loop.events.append(("generate_start", step, version))
            loop.generating += 1
            self.in_flight_max = max(self.in_flight_max, loop.generating)
        time.sleep(loop.generate_s)
        with loop.lock:
            loop.generating -= 1
            self.engine_store[step] = [version] * SAMPLES
        meta = RolloutMeta(
            indices=list(range(SAMPLES)),
            seq_lens=[3] * SAMPLES,
            response_lens=[1] * SAMPLES,
            rewards=[0.0] * SAMPLES,
            weight_versions=[version] * SAMPLES,
        )
        return HeldRollout(
            meta=meta, held=step, num_shards=1, micro_batch_size=1, pad_id=0, max_seq_len=3, slot=request.slot
        )


class AsyncFakeLoop(FakeLoop):
    def __post_init__(self):
        super().__post_init__()
        self.transfer = AsyncFakeTransfer(self)

    def rollout_request(self, step):
        from types import SimpleNamespace

        with self.lock:
            self.events.append(("request", step))
        return SimpleNamespace(step=step, slot=0)

    def sync_engines(self, timings):
        """Weights move into generations in flight (that is the point of pipeline=async)."""
        if self.version != self.trained:
            with self.lock:
                self.events.append(("sync", self.trained))
                self.version = self.trained


def test_async_with_staleness_0_is_the_sync_pipeline_step_for_step():
    loop, pipeline = AsyncFakeLoop(num_steps=4, generate_s=0.01), AsyncPipeline(max_staleness=0)
    try:
        rows = [loop.step(pipeline, k) for k in range(1, 5)]
    finally:
        pipeline.close(loop)
    assert all(r["staleness"] == [0] * SAMPLES for r in rows)
    assert _handed_over(loop) == [(1, 0), (2, 1), (3, 2), (4, 3)]  # as test_sync_pipeline_is_on_policy
    assert loop.transfer.in_flight_max == 1


@pytest.mark.parametrize("eta", [1, 2, 3])
def test_async_keeps_every_rollout_within_max_staleness_and_runs_rollouts_at_once(eta):
    """The engines run eta + 1 rollouts ahead at most, several at once; none trains on weights more
    than eta versions newer than those it started with, and the bound is reached (the trainers
    are fast, the engines slow); every step's rollout is drawn once, in order, nothing beyond the end."""
    loop, pipeline = AsyncFakeLoop(num_steps=8, generate_s=0.05, train_s=0.0), AsyncPipeline(max_staleness=eta)
    try:
        rows = [loop.step(pipeline, k) for k in range(1, 9)]
    finally:
        pipeline.close(loop)
    staleness = [max(r["staleness"]) for r in rows]
    assert max(staleness) == eta and min(staleness) == 0
    assert [e[1] for e in loop.events if e[0] == "request"] == list(range(1, 9))
    assert [s for s, _ in _handed_over(loop)] == list(range(1, 9))
    # Step j starts once the engines hold version j - 1 - eta.
    assert all(v >= j - 1 - eta for (_, j, v) in (e for e in loop.events if e[0] == "generate_start"))
    assert loop.transfer.in_flight_max == eta + 1
    assert all(r["rollout_wait"] >= 0 for r in rows)


def test_async_checkpoint_drains_and_carries_every_rollout_generated_ahead():
    loop, pipeline = AsyncFakeLoop(num_steps=6, generate_s=0.03), AsyncPipeline(max_staleness=2)
    for k in (1, 2):
        loop.step(pipeline, k)
    pending = pipeline.pending(loop)  # waits for the rollouts in flight, reads them off the engines
    assert [h.step for h in pending] == [3, 4, 5] and all(h.held[0] == h.step for h in pending)
    assert loop.version == loop.trained == 2
    pipeline.close(loop)

    resumed = AsyncFakeLoop(num_steps=6, version=2, trained=2)
    again = AsyncPipeline(max_staleness=2)
    again.restore(resumed, pending)
    for k in (3, 4, 5, 6):
        resumed.step(again, k)
    again.close(resumed)
    assert [e[1] for e in resumed.events if e[0] == "generate_start"] == [6]  # 3-5 were not drawn again
    assert [s for s, _ in _handed_over(resumed)] == [3, 4, 5, 6]


def test_async_answers_rollout_threads_while_it_moves_rollouts():
    """A rollout thread replacing a dead engine asks `holds_finished_rollouts` while the main thread
    starts, takes and settles rollouts: the answer never fails on the rollouts changing under it
    ("dictionary changed size during iteration")."""
    steps = 400
    loop, pipeline = AsyncFakeLoop(num_steps=steps, generate_s=0.0, train_s=0.0), AsyncPipeline(max_staleness=3)
    errors, stop = [], threading.Event()

    def ask() -> None:
        while not stop.is_set():
            try:
                pipeline.holds_finished_rollouts()
                pipeline.holds_rollout()
            except RuntimeError as e:
                errors.append(e)
                return

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        for k in range(1, steps + 1):
            loop.step(pipeline, k)
    finally:
        stop.set()
        asker.join()
        pipeline.close(loop)
    assert not errors, errors[0]
