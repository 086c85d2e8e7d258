"""SIGINT / SIGTERM during training: the first asks the run to stop after the step in progress
(checkpoint, summary, exit 128 + signal); a second one aborts at once.

Slurm's preemption and `scancel` send SIGTERM (then SIGKILL after its grace period), a terminal's
Ctrl-C sends SIGINT. Installed after `ray.init`, which sets a SIGTERM handler of its own.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalAbort(BaseException):
    """A second stop signal: abandon the step in progress now. A BaseException, so no
    `except Exception` on the way up swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"{self.name} received twice: aborted")


class StopRequest:
    """Which stop signal arrived, if any; `installed()` handles SIGINT and SIGTERM meanwhile."""

    def __init__(self, on_first: str = "stopping after this step") -> None:
        self.signum: Optional[int] = None
        self.on_first = on_first

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals are delivered to the main thread only
            return
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise SignalAbort(signum)
        self.signum = signum
        print(f"\n{self.name} received: {self.on_first} (send it again to abort now)", file=sys.stderr, flush=True)
