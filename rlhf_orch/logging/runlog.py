"""<run dir>/run.log: everything the driver prints on the console, as plain text.

`tee_console(path)` replaces sys.stdout and sys.stderr with tees for the length of a run: what is
written goes to the console unchanged (a TTY stays a TTY: `isatty` and `fileno` are the real
stream's) and, without ANSI escapes, to run.log. What Ray, vLLM and DeepSpeed print goes to
ray_workers.log instead (`LibraryOutput`) and reaches neither, unless `logger.verbose=true` streams it
to the console (then it is console output and is in run.log too).

A rich progress bar must not be teed (its redraws would fill the file): `ConsoleLogger` draws it on
`terminal()`, the real stdout, writes its own lines to the log with `log_only`, and while the bar is
live, `set_divert(fn)` sends the console side of every print to `fn` (which prints it above the bar)
while the log side still gets it.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Optional

RUN_LOG = "run.log"
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")
_active: Optional["_RunLog"] = None


class _RunLog:
    def __init__(self, path: Path, stdout: Any, stderr: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file: IO[str] = open(path, "a", encoding="utf-8", errors="replace")
        self.stdout, self.stderr = stdout, stderr
        self.divert: Optional[Callable[[str], None]] = None
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            if not self.file.closed:
                self.file.write(strip_ansi(text).replace("\r\n", "\n"))
                if "\n" in text:
                    self.file.flush()


class _Tee:
    """A console stream that also writes to run.log."""

    def __init__(self, stream: Any, log: _RunLog) -> None:
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        self._log.write(text)
        divert = self._log.divert
        if divert is not None:
            divert(text)
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...
        return getattr(self._stream, name)


def strip_ansi(text: str) -> str:
    """`text` without terminal colour and control sequences (what a log file should hold)."""
    return _ANSI.sub("", text)


@contextmanager
def tee_console(path: Path) -> Iterator[Path]:
    """stdout and stderr also into `path` (appended: a resumed run continues its run.log)."""
    global _active
    previous = _active
    log = _RunLog(Path(path), sys.stdout, sys.stderr)
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    _active = log
    try:
        yield log.path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = log.stdout, log.stderr
        _active = previous
        with log.lock:
            log.file.close()


def active() -> bool:
    return _active is not None


def terminal() -> Any:
    """The real stdout while a run's console is teed (sys.stdout otherwise)."""
    return _active.stdout if _active is not None else sys.stdout


def log_only(text: str) -> None:
    """Into run.log, not onto the console (what a progress bar shows instead)."""
    if _active is not None:
        _active.write(text if text.endswith("\n") else text + "\n")


def set_divert(fn: Optional[Callable[[str], None]]) -> None:
    """While a progress bar is live: the console side of every print goes to `fn` (None: back to
    the console)."""
    if _active is not None:
        _active.divert = fn
