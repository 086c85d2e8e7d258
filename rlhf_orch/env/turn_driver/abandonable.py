"""Work on a thread of its own that can be given up: an environment step (`env.tool_timeout_s`) runs
on one each. (Agent functions run in processes of their own: rlhf_orch.env.agent_driver.host.)

A pool of a fixed number of threads would not do: a step that hangs keeps its worker for ever, so
the steps queued behind it time out without having started, and score 0. Here every call gets a
fresh thread, so its deadline counts from its start, and one that runs past it is abandoned: the
caller stops waiting and `abandon` raises `Abandoned` in the thread between two bytecodes
(`PyThreadState_SetAsyncExc`, as the reward watchdog does) -- that ends a Python loop at once; a
sleep, a socket read or a call inside C code ends first, then the thread does. It is sent only while
the call is still inside `fn` (a lock orders it with the call's end; one still pending when the call
returns is dropped), so it never reaches the thread's next work or a thread that reused its id.

What it cannot do: stop code that catches BaseException and goes on (the sandbox, `env=python_tool`,
runs the model's code in a child process for that reason), and undo what the exception interrupts --
raised inside a library's critical section (a lock taken without `with`, a shared HTTP client) it may
leave that half done. It is the last resort for a call that overran its deadline, not a way to cancel
healthy work.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from typing import Any, Callable


class Abandoned(BaseException):
    """Raised inside a call that ran past its deadline (a BaseException: `except Exception` in the
    environment's or agent's code does not swallow it)."""


class _Call:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = False  # the thread is running `fn` (only then may Abandoned be sent)
        self.ident: int | None = None


def _send(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


def start(fn: Callable[..., Any], *args: Any, name: str = "abandonable", **kwargs: Any) -> cf.Future:
    """`fn(*args, **kwargs)` on a new daemon thread; its Future (pass it to `abandon` to give up)."""
    future: cf.Future = cf.Future()
    call = _Call()

    def body() -> None:
        if not future.set_running_or_notify_cancel():
            return
        failed, outcome = False, None
        try:
            try:
                with call.lock:
                    call.ident, call.inside = threading.get_ident(), True
                outcome = fn(*args, **kwargs)
            finally:
                with call.lock:
                    call.inside = False
                    _send(threading.get_ident(), None)  # an Abandoned sent as `fn` returned: dropped
        except BaseException as e:  # the call's outcome, Abandoned included
            failed, outcome = True, e
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    future.call = call  # type: ignore[attr-defined] - where `abandon` finds the thread
    threading.Thread(target=body, name=name, daemon=True).start()
    return future


def abandon(future: cf.Future) -> bool:
    """Stop waiting for `future`'s call and raise `Abandoned` in its thread while it is still inside
    the call; False when the call had ended (nothing is sent)."""
    call: _Call | None = getattr(future, "call", None)
    if call is None:
        return False
    with call.lock:
        if not call.inside or call.ident is None:
            return False
        _send(call.ident, Abandoned)
        return True
