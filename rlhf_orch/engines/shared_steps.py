"""How several rollouts share one vLLM engine at once (pipeline=async): a part of `VLLMEngine`.

Each rollout call enqueues its requests with an outbox; every engine step -- whoever makes it --
advances all requests in flight, and each finished one lands in the outbox of the call that made
it: continuous batching across rollouts. Every call into vLLM runs on one thread of its own
(`EngineThread`) when the actor is threaded: vLLM is not thread-safe, and on CPU each calling
thread would bring its own OpenMP pool, all spinning on the same cores (seen: a rollout 100x
slower). A weight update lands between two engine steps (the requests in flight go on with the new
weights and are marked interrupted), pauses the steps while it is made of several calls
(`pause_for_update` ... `update_landed`), or -- `finish_before_update` -- waits until the
requests in flight finish, no new one starting meanwhile. The engine's weight version lives here:
every request records the version it started with.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

from rlhf_orch.liveness import WorkCount


class SharedEngineSteps:
    """The shared stepping of one engine: the state the rollouts on it share (several at once under
    pipeline=async), and `run`, which sends a call to vLLM's thread.

    `llm`: the engine's vllm.LLM; `weights_present()`: the engine's check before sampling (refuse
    weights a sleep dropped); `engine_thread`: the thread running every vLLM call of a threaded
    actor (None: the caller's); `finish_before_update`: pipeline.partial_rollout=false.
    """

    def __init__(
        self,
        llm: Any,
        weights_present: Callable[[], None],
        *,
        finish_before_update: bool,
        engine_thread: EngineThread | None,
    ):
        self.llm = llm
        self.weights_present = weights_present
        self.finish_before_update = finish_before_update
        self._engine_thread = engine_thread
        self.weight_version = 0
        self.reset_generation_state()

    def reset_generation_state(self) -> None:
        """No rollout, update or request of earlier calls (the engine thread stays)."""
        self._cond = threading.Condition()  # guards the fields below; signals the end of an update
        self._updating = False  # between pause_for_update and update_landed: no engine step
        self._closed = False  # an update waits for the requests in flight: no new request starts
        self._outboxes: dict[str, list[Any]] = {}  # request id -> finished outputs of the call that made it
        self._started_at: dict[str, int] = {}  # request id -> weight version when it was enqueued
        self._interrupted: set[str] = set()  # requests a weight update reached while in flight
        self.env_rollout = threading.Lock()  # one agent rollout at a time (see VLLMRollouts._complete_env)
        # Multi-turn rollouts (agent or turn-driven) started and not ended: under
        # finish_before_update an update waits for them (`finish_in_flight`), so no trajectory
        # takes an update between two of its turns.
        self._sessions = 0
        self.steps_made = 0  # engine steps made (a plain int: read by the monitor thread, never locked)
        self.samples_scored = WorkCount()  # samples the rule scored here (scoring threads: several under async)

    @property
    def engine_thread(self) -> EngineThread | None:
        return self._engine_thread

    def in_flight(self) -> bool:
        """(vLLM's thread.) Requests or an agent rollout of earlier calls still running."""
        return bool(self.llm.llm_engine.has_unfinished_requests() or self._started_at or self.env_rollout.locked())

    def run(self, fn, *args):
        """`fn(*args)` on the thread that owns vLLM (a threaded actor), or right here. Never
        called holding `_cond` (fn may take it)."""
        if self._engine_thread is None:
            return fn(*args)
        return self._engine_thread.call(fn, *args)

    def count_step(self) -> None:
        """(vLLM's thread.) One more engine step made: what `progress` reports to the driver (every
        engine step counts, the ones an agent session makes on its own too)."""
        self.steps_made += 1

    def enqueue(self, prompts, params, outbox: list[Any]) -> list[str]:
        """(vLLM's thread.) Add the requests; their finished outputs will go to `outbox`."""
        self.weights_present()
        # enqueue returns vLLM's internal ids ("<external>-<8 random chars>"); outputs carry the
        # external one. Key by the external id.
        keys = [str(rid).rsplit("-", 1)[0] for rid in self.llm.enqueue(prompts, params, use_tqdm=False)]
        with self._cond:
            for key in keys:
                self._outboxes[key] = outbox
                self._started_at[key] = self.weight_version
        return keys

    def step(self) -> bool:
        """(vLLM's thread.) One engine step for every request in flight, each finished one handed
        to its call's outbox; False when vLLM has nothing left. No step while an update is open."""
        if self._updating:
            return True  # (an update opened after the caller looked: it asks again once it is whole)
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return False
        outputs = engine.step()
        self.count_step()
        for out in outputs:
            if out.finished:
                with self._cond:
                    box = self._outboxes.pop(str(out.request_id), None)
                    if box is not None:
                        box.append(out)
        return True

    def mark_interrupted(self) -> None:
        """(Holding `_cond`, as a weight update lands.) The requests still generating go on with the
        new weights: interrupted. One that finished before the update but whose call has not taken
        it yet (in its outbox, still in `_started_at`) was made wholly with the old weights: not."""
        self._interrupted |= set(self._outboxes)

    def pause_for_update(self) -> None:
        """An update of several calls opens: no engine step until it lands (`update_landed`)."""
        with self._cond:
            self._updating = True

    def update_landed(self) -> None:
        """(vLLM's thread, the new version published.) The requests in flight go on with the new
        weights (interrupted); steps and new requests resume."""
        with self._cond:
            self.mark_interrupted()
            self._updating = self._closed = False
            self._cond.notify_all()

    def take_versioned(self, outbox: list[Any]) -> tuple[list[Any], dict[str, int], set[str]]:
        """Empty `outbox`: its finished outputs, the version each started with, and those a weight
        update reached in flight."""
        with self._cond:
            ready = list(outbox)
            outbox.clear()
            versions = {str(o.request_id): self._started_at.pop(str(o.request_id)) for o in ready}
            interrupted = {k for k in versions if k in self._interrupted}
            self._interrupted -= interrupted
            if ready and not self._started_at:
                self._cond.notify_all()  # an update waiting for the requests in flight may go
        return ready, versions, interrupted

    def forget(self, keys) -> None:
        with self._cond:
            for key in keys:
                self._outboxes.pop(key, None)
                self._started_at.pop(key, None)
                self._interrupted.discard(key)
            if not self._started_at:
                self._cond.notify_all()

    def submit(self, prompts, params, outbox: list[Any]) -> list[str]:
        """(A rollout's thread.) New requests, once no update holds them back; their ids."""
        self.wait_for_update(new_requests=True)
        return self.run(self.enqueue, prompts, params, outbox)

    def submit_in_session(self, prompts, params, outbox: list[Any]) -> list[str]:
        """(A multi-turn rollout's thread, inside its session.) A trajectory's next turn: an
        update waiting for the sessions in flight does not hold it back (it waits for this one)."""
        self.wait_for_update()
        return self.run(self.enqueue, prompts, params, outbox)

    def advance(self) -> bool:
        """(A rollout's thread.) One engine step, once no update is open (`step`)."""
        self.wait_for_update()
        return self.run(self.step)

    def abort(self, keys: list[str]) -> None:
        self.run(self.llm.llm_engine.abort_request, keys)
        self.forget(keys)

    def stepping(self) -> Any:
        """This engine's steps, shared by every rollout it generates, for a multi-turn driver
        running on the caller's thread inside its session (`session_starts`): a turn is a new
        request, like a rollout's, that an update waiting for the sessions does not hold back."""
        from rlhf_orch.engines.request_steps import SharedStepping

        return SharedStepping(
            enqueue=self.submit_in_session,
            step=self.advance,
            take=lambda outbox: self.take_versioned(outbox)[0],
            abort=self.abort,
        )

    def wait_for_update(self, new_requests: bool = False) -> None:
        """Wait until no weight update is open -- or, before `new_requests`, waiting for the
        requests in flight to finish (not on vLLM's thread: the update needs it)."""
        if self._engine_thread is not None and self._engine_thread.is_current():
            return  # the caller loops; the update's calls run on this thread between its steps
        with self._cond:
            while self._updating or (new_requests and self._closed):
                self._cond.wait()

    def finish_in_flight(self) -> None:
        """Before a weight update (spec.finish_before_update): no new request starts, and the
        requests in flight finish with the weights they started with -- and so does every
        multi-turn rollout in flight, whole (env=agent: its model calls reach vLLM through the
        endpoint, not `enqueue`; turn-driven: between two turns no request is in flight). The
        update waits for the sessions, and no new one starts."""
        if not self.finish_before_update or self._engine_thread is None:
            return
        with self._cond:
            self._closed = True
            while self._started_at or self._sessions:
                self._cond.wait()

    def session_starts(self) -> None:
        """(A rollout's thread.) A multi-turn rollout begins once no update holds new requests
        back; counted, so an update that finishes the requests in flight first waits for its end."""
        with self._cond:
            while self._updating or self._closed:
                self._cond.wait()
            self._sessions += 1

    def session_ends(self) -> None:
        with self._cond:
            self._sessions -= 1
            if not self._sessions:
                self._cond.notify_all()  # an update waiting for the sessions may go


def version_spans(spans: Any) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's spans as plain (start, end, version) runs over the completion's tokens (None without)."""
    return tuple((int(s.start), int(s.end), int(s.version)) for s in spans) if spans else None


def mean_version(spans: Any, started: int) -> float:
    """The mean weight version over a completion's tokens, from vLLM's spans (`started` without)."""
    if not spans:
        return float(started)
    tokens = sum(s.end - s.start for s in spans)
    return sum(int(s.version) * (s.end - s.start) for s in spans) / tokens if tokens else float(started)


class EngineThread:
    """One thread that runs every call into vLLM of a threaded engine actor, in submission order."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        if self.is_current():
            return fn(*args)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, done))
        return done.result()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        while True:
            fn, args, done = self._calls.get()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # handed to the caller
                done.set_exception(e)
