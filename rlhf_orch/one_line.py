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
    raw = [line for line in text.splitlines() if line.strip()]
    lines = [line.strip() for line in raw]
    dead = [line for line in lines if line.startswith("The actor is dead because")]
    if dead:
        kept = dead[:1]
    elif any(line.startswith(TRACEBACK) for line in lines):
        # A remote traceback: its frames are indented; the exception it ends with is not.
        start = next(k for k, line in enumerate(raw) if line.strip().startswith(TRACEBACK))
        kept = [
            line.strip() for line in raw[start + 1 :] if not line[0].isspace() and not _traceback_line(line.strip())
        ][-1:]
    else:
        kept = lines[:1]
    line = kept[0].rstrip(":") if kept else (type(error).__name__ if isinstance(error, BaseException) else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# The run's actor classes, as a person calls them.
ROLES = {
    "VLLMEngine": "a vLLM engine",
    "PolicyWorker": "a policy rank",
    "CriticWorker": "a critic rank",
    "ReferenceWorker": "a reference rank",
    "RewardModelWorker": "a reward-model rank",
}


def dead_actor(error: BaseException) -> tuple[str | None, str]:
    """(who died -- "a policy rank", None when Ray does not say --, why) from Ray's actor error."""
    text = _ANSI.sub("", str(error))
    found = re.search(r"class_name:\s*(\w+)", text)
    who = ROLES.get(found.group(1), found.group(1)) if found else None
    why = re.search(r"The actor is dead because (.+)", text)
    return who, (why.group(1).strip().rstrip(".") if why else one_line(error))


def named(error: BaseException) -> str:
    """`Type: message` of the exception an actor raised, in one line."""
    cause = cause_of(error)
    return f"{type(cause).__name__}: {one_line(cause)}"


TRACEBACK = "Traceback (most recent call last)"


def _traceback_line(line: str) -> bool:
    return line.startswith((TRACEBACK, 'File "', "^", "ray::", "The above exception", "During handling"))
