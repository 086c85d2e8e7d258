"""Scoring a batch so that slow or broken verifiers never stall a PPO step.

A reward that raises on one sample scores that sample 0 and is counted (`errors`); a sample running
past `timeout_s` scores 0 and is counted (`timeouts`); the batch always completes. A reward that
*returns* something other than a finite real number is a bug and stops the run (RewardError).

Two ways to run:

* inline (`pool_size == 0`): in the calling process, with a per-sample SIGALRM timer
  (`signal.setitimer(ITIMER_REAL)`). Signals can only be handled in the main thread, so off the main
  thread samples run without a per-sample timeout. Measured with Ray 2.60 (`ray.init(num_cpus=1)`,
  `threading.current_thread() is threading.main_thread()` inside the method): methods of a plain
  (synchronous, max_concurrency=1, no concurrency group) actor and Ray tasks run in the worker's
  main thread; methods of threaded actors (max_concurrency > 1, or any concurrency group: every
  engine has one for its liveness check) and of async actors run in other threads ("Dummy-1",
  "AsyncIO Thread: default"). There a watchdog thread raises the timeout into the scoring thread
  instead (`PyThreadState_SetAsyncExc`). Either way the timeout is an exception raised between
  bytecodes: it stops Python loops (the alarm also interrupts a sleep; the watchdog's exception
  waits for it to end), not a long call inside C code, nor a verifier that catches BaseException
  and keeps going; only the pool can stop those.
* a pool of Ray tasks (`pool_size > 0`): the batch is split into `pool_size` near-equal chunks, one
  task each, each task scoring its chunk inline with the per-sample timer (a task runs in its
  worker's main thread). The caller gives each task `timeout_s * len(chunk) + grace_s`; a task still
  running then (a verifier that swallows the alarm or is stuck in C code) is killed with
  `ray.cancel(force=True)` and its samples count as timeouts.

Functions with `batched = True` are one call for the whole batch, inline, timed as a whole
(`timeout_s * len(batch)`): an exception or a timeout scores every sample 0.

`on_scored` (the engine's liveness count, `VLLMEngine.progress`) is called as the batch moves:
inline after every sample (a batched function: once, when its call returns); with the pool
whenever a chunk comes back and at least every `POOL_PROGRESS_S` while the chunks still within
their deadlines run -- each is killed at its deadline, so that wait cannot be a stuck one. A
verifier that keeps scoring is never taken for a stuck engine, however large the batch; one
sample still gets `timeout_s` at most.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.reward.base import Response, RewardError, RewardFunction, as_score
from rlhf_orch.reward.options import RuleRewardConfig

logger = logging.getLogger(__name__)

# Seconds a pool task may take beyond its samples' time limits: worker start-up, imports, transfer.
POOL_GRACE_S = 10.0
# Longest wait on the pool's tasks between two calls of `on_scored` (the engine's liveness count).
POOL_PROGRESS_S = 1.0
# Pool tasks reserve no CPU: the pool is bounded by pool_size, and a CPU request (even 0.01) never
# fits when actors or placement groups reserve every CPU (measured: it stays pending). "DEFAULT" keeps
# them out of the engine's placement group, which engines join with capture_child_tasks=True.
_POOL_TASK_OPTIONS = {"num_cpus": 0, "max_retries": 0, "scheduling_strategy": "DEFAULT"}


@dataclass
class ScoredBatch:
    """Scores of one batch and what went wrong on the way (for the step's metrics and the log)."""

    scores: list[float]
    errors: int  # samples whose function raised (scored 0)
    timeouts: int  # samples that exceeded timeout_s (scored 0)
    seconds: float
    first_error: Optional[str]  # "path:line: ExcType: msg" or repr of the first failure, for the log


class _SampleTimeout(BaseException):
    """Raised by the SIGALRM handler. A BaseException, so a verifier's `except Exception` (math-verify
    and sympy have many) does not swallow it."""


def _timer_available() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _run_timed(call: Callable[[], Any], seconds: float) -> tuple[str, Any]:
    """Run `call` under a SIGALRM deadline: ("ok", value), ("error", exception) or ("timeout", None).

    RewardError propagates. The previous SIGALRM handler and ITIMER_REAL timer (e.g. pytest-timeout's)
    are restored afterwards, with the time that passed subtracted.
    """
    if not _timer_available():
        return _run_timed_off_main_thread(call, seconds)

    # The handler raises at most once and only while armed, so an alarm landing after `call` returned
    # (before the timer is disarmed) cannot escape into the caller.
    state = {"armed": False, "fired": False}

    def on_alarm(signum: int, frame: Any) -> None:
        if state["armed"]:
            state["armed"] = False
            state["fired"] = True
            raise _SampleTimeout()

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_timer = (0.0, 0.0)
    start = time.monotonic()
    try:
        state["armed"] = True
        previous_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
        value = call()
        state["armed"] = False
        # `fired` with a normal return: the function caught our exception (bare except) and went on.
        outcome = ("timeout", None) if state["fired"] else ("ok", value)
    except _SampleTimeout:
        outcome = ("timeout", None)
    except RewardError:
        state["armed"] = False
        raise
    except Exception as exc:
        state["armed"] = False
        outcome = ("timeout", None) if state["fired"] else ("error", exc)
    finally:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if previous_timer[0] > 0:
            remaining = previous_timer[0] - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_timer[1])
    return outcome


def _run_timed_off_main_thread(call: Callable[[], Any], seconds: float) -> tuple[str, Any]:
    """`_run_timed` for a thread that is not the main one (every engine: its calls run on Ray's
    threads, since it answers liveness checks on a thread of its own). No signal can reach it, so a
    watchdog timer raises the timeout in it (`PyThreadState_SetAsyncExc`): like the alarm, between
    two bytecodes -- it stops Python loops; a sleep or a blocking call ends first (the pool stops those)."""
    import ctypes

    target = threading.get_ident()
    state = {"armed": True, "fired": False}
    lock = threading.Lock()

    def fire() -> None:
        with lock:
            if state["armed"]:
                state["armed"], state["fired"] = False, True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(_SampleTimeout))

    watchdog = threading.Timer(seconds, fire)
    watchdog.daemon = True
    outcome: tuple[str, Any] = ("timeout", None)
    try:
        try:
            watchdog.start()
            value = call()
            outcome = ("timeout", None) if state["fired"] else ("ok", value)
        finally:
            with lock:  # from here on the watchdog raises nothing into this thread
                state["armed"] = False
                if state["fired"]:  # one it raised that is still pending is dropped, not left to escape later
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
            watchdog.cancel()
    except _SampleTimeout:
        outcome = ("timeout", None)
    except RewardError:
        raise
    except Exception as exc:
        outcome = ("timeout", None) if state["fired"] else ("error", exc)
    return outcome


def _checked(fn: RewardFunction, value: Any, index: int, response: Response) -> float:
    score = as_score(value)
    if score is None:
        what = "a dict without a 'score' key" if isinstance(value, Mapping) else repr(value)[:80]
        raise RewardError(
            f"reward {fn.name!r} returned {what} for sample {index} (response {response.text[:80]!r}); "
            f"a reward must be a finite real number"
        )
    return score


def _score_inline(
    fn: RewardFunction,
    prompts: Sequence[Prompt],
    responses: Sequence[Response],
    timeout_s: float,
    offset: int = 0,
    on_scored: Callable[[], None] = lambda: None,
) -> ScoredBatch:
    """Score in this process; `offset` is the index of the first sample in the caller's batch;
    `on_scored` after every sample (a batched function: after its one call)."""
    start = time.monotonic()
    # Imports (a user's file, sympy) happen here, untimed: a slow import must not time out sample 0.
    fn.check()
    n = len(prompts)
    if fn.batched:
        status, value = _run_timed(lambda: fn.score_batch(prompts, responses), timeout_s * n)
        on_scored()
        if status == "ok":
            if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") or len(value) != n:
                raise RewardError(f"reward {fn.name!r} is batched and returned {repr(value)[:80]} for {n} samples")
            scores = [_checked(fn, v, offset + i, r) for i, (v, r) in enumerate(zip(value, responses))]
            return ScoredBatch(scores, 0, 0, time.monotonic() - start, None)
        if status == "error":
            first = fn.describe_error(value)
            return ScoredBatch([0.0] * n, n, 0, time.monotonic() - start, first)
        first = f"batch of {n} timed out after {timeout_s * n:g} s"
        return ScoredBatch([0.0] * n, 0, n, time.monotonic() - start, first)

    scores: list[float] = []
    errors = timeouts = 0
    first_error: Optional[str] = None
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        status, value = _run_timed(lambda: fn.score(prompt, response), timeout_s)
        on_scored()
        if status == "ok":
            scores.append(_checked(fn, value, offset + i, response))
            continue
        scores.append(0.0)
        if status == "error":
            errors += 1
            if first_error is None:
                first_error = f"sample {offset + i}: {fn.describe_error(value)}"
        else:
            timeouts += 1
            if first_error is None:
                first_error = f"sample {offset + i}: timed out after {timeout_s:g} s"
    return ScoredBatch(scores, errors, timeouts, time.monotonic() - start, first_error)


def _pool_chunk(fn, prompts, responses, timeout_s, offset):
    """Body of one pool task. RewardError comes back as a value so the caller re-raises it as is."""
    try:
        return "ok", _score_inline(fn, prompts, responses, timeout_s, offset)
    except RewardError as exc:
        return "fatal", str(exc)


_remote_chunk = None


def _score_pool(
    fn: RewardFunction,
    prompts: Sequence[Prompt],
    responses: Sequence[Response],
    timeout_s: float,
    pool_size: int,
    grace_s: float,
    on_scored: Callable[[], None] = lambda: None,
) -> ScoredBatch:
    global _remote_chunk
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            f"reward.pool_size={pool_size} scores in Ray tasks, but Ray is not initialised in this process "
            "(call ray.init first, or set reward.pool_size=0 to score inline)"
        )
    if _remote_chunk is None:
        _remote_chunk = ray.remote(**_POOL_TASK_OPTIONS)(_pool_chunk)
    start = time.monotonic()
    n = len(prompts)
    chunks = min(pool_size, n)
    bounds = [(k * n // chunks, (k + 1) * n // chunks) for k in range(chunks)]
    fn_ref = ray.put(fn)  # shipped once, shared by the tasks
    refs = {}
    for lo, hi in bounds:
        ref = _remote_chunk.remote(fn_ref, list(prompts[lo:hi]), list(responses[lo:hi]), timeout_s, lo)
        refs[ref] = (lo, hi, start + timeout_s * (hi - lo) + grace_s)

    scores = [0.0] * n
    errors = timeouts = 0
    failures: dict[int, str] = {}  # first failure by sample index, so first_error is the batch's first
    pending = list(refs)
    try:
        while pending:
            next_deadline = min(refs[r][2] for r in pending)
            wait_s = min(max(0.0, next_deadline - time.monotonic()), POOL_PROGRESS_S)
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            on_scored()  # (a chunk back, or every task still within its deadline)
            for ref in ready:
                lo, hi, _ = refs[ref]
                try:
                    status, result = ray.get(ref)
                except Exception as exc:  # the worker died (segfault, OOM kill): the chunk failed
                    errors += hi - lo
                    failures[lo] = f"samples {lo}-{hi - 1}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    continue
                if status == "fatal":
                    raise RewardError(result)
                scores[lo:hi] = result.scores
                errors += result.errors
                timeouts += result.timeouts
                if result.first_error is not None:
                    failures[lo] = result.first_error
            now = time.monotonic()
            for ref in [r for r in pending if refs[r][2] <= now]:
                lo, hi, _ = refs[ref]
                ray.cancel(ref, force=True)
                pending.remove(ref)
                timeouts += hi - lo
                failures[lo] = f"samples {lo}-{hi - 1}: pool task killed after {refs[ref][2] - start:.1f} s"
    finally:
        for ref in pending:  # only after a RewardError: do not leave tasks running
            ray.cancel(ref, force=True)
    first_error = failures[min(failures)] if failures else None
    return ScoredBatch(scores, errors, timeouts, time.monotonic() - start, first_error)


def score_batch(
    fn: RewardFunction,
    prompts: Sequence[Prompt],
    responses: Sequence[Response],
    timeout_s: float,
    pool_size: int = RuleRewardConfig.pool_size,
    *,
    grace_s: float = POOL_GRACE_S,
    on_scored: Callable[[], None] = lambda: None,
) -> ScoredBatch:
    """Score a batch with `fn`: every sample gets a finite score, failures are counted, never fatal.

    `timeout_s` is per sample (the smaller of it and `fn.timeout_s` when the function sets one);
    `pool_size > 0` scores in that many Ray tasks (Ray must be initialised), 0 inline. Raises
    RewardError when `fn` returns something that is not a finite real number, or cannot be loaded.
    `on_scored`: called as the batch moves (the caller's liveness count; see the module's doc).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"reward.timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 0:
        raise ValueError(f"reward.pool_size must be an integer >= 0, got {pool_size!r}")
    if fn.timeout_s is not None:
        timeout_s = min(float(timeout_s), float(fn.timeout_s))
    if not prompts:
        return ScoredBatch([], 0, 0, 0.0, None)
    if pool_size == 0 or fn.batched:
        return _score_inline(fn, prompts, responses, float(timeout_s), on_scored=on_scored)
    return _score_pool(fn, prompts, responses, float(timeout_s), pool_size, grace_s, on_scored)
