"""Failures in one plain line: what a person reads on the console and in summary.json.

Ray's error texts span many lines (the remote traceback, ANSI colour codes, advice on debugging);
the line that says what happened is the exception's own message, or Ray's "The actor is dead
because ..." for a process that vanished. The whole traceback goes to <run dir>/error.log.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_CHARS = 400


def cause_of(error: BaseException) -> BaseException:
    """The exception an actor raised, for a Ray task error wrapping it (the error itself otherwise)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def one_line(error: BaseException | str, limit: int = MAX_CHARS) -> str:
    """`error`'s message in one line without colour codes or traceback fragments."""
    text = _ANSI.sub("", error if isinstance(error, str) else str(cause_of(error)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    dead = [line for line in lines if line.startswith("The actor is dead because")]
    kept = dead[:1] or [line for line in lines if not _traceback_line(line)][:1]
    line = kept[0] if kept else (type(error).__name__ if isinstance(error, BaseException) else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def named(error: BaseException) -> str:
    """`Type: message` of the exception an actor raised, in one line."""
    cause = cause_of(error)
    return f"{type(cause).__name__}: {one_line(cause)}"


def _traceback_line(line: str) -> bool:
    return line.startswith(("Traceback (most recent call last)", 'File "', "^", "ray::")) or line.startswith("The above exception")
