"""Work on a thread of its own that can be given up: an environment step (`env.tool_timeout_s`) and
a plain (not `async def`) agent function (`env.timeout_s`) run on one each.

A pool of a fixed number of threads would not do: a step that hangs keeps its worker for ever, so
the steps queued behind it time out without having started, and score 0. Here every call gets a
fresh thread, so its deadline counts from its start, and one that runs past it is abandoned: the
caller stops waiting and `abandon` raises `Abandoned` in the thread between two bytecodes
(`PyThreadState_SetAsyncExc`, as the reward watchdog does) -- that ends a Python loop at once; a
sleep, a socket read or a call inside C code ends first, then the thread does. Code that catches
BaseException and goes on cannot be stopped from inside the process: the sandbox (`env=python_tool`)
runs the model's code in a child process for that reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from typing import Any, Callable


class Abandoned(BaseException):
    """Raised inside a call that ran past its deadline (a BaseException: `except Exception` in the
    environment's or agent's code does not swallow it)."""


def start(fn: Callable[..., Any], *args: Any, name: str = "abandonable", **kwargs: Any) -> cf.Future:
    """`fn(*args, **kwargs)` on a new daemon thread; its Future (pass it to `abandon` to give up)."""
    future: cf.Future = cf.Future()

    def body() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the call's outcome, Abandoned included
            future.set_exception(e)
        else:
            future.set_result(result)

    thread = threading.Thread(target=body, name=name, daemon=True)
    future.thread = thread  # type: ignore[attr-defined] - where `abandon` finds it
    thread.start()
    return future


def abandon(future: cf.Future) -> bool:
    """Stop waiting for `future`'s call and raise `Abandoned` in its thread; False when it had ended."""
    thread = getattr(future, "thread", None)
    if future.done() or thread is None or not thread.is_alive() or thread.ident is None:
        return False
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Abandoned))
    return True
