"""The mistakes Hydra catches before our checks, as one line with the closest valid names, exit 2.

Hydra reports an unknown key, an unknown option or a malformed override in several lines ending in
"Set the environment variable HYDRA_FULL_ERROR=1", suggests `+key=value` (which would add a key
that nothing reads) and exits 1. `one_line` turns its exception into what every other config error
looks like:

    error: algo.clip_ratio: no such key in algo (PPOConfig); did you mean algo.clip_ratio_c or ...
    error: algo=grpoo: no such option in algo; did you mean algo=grpo or algo=rloo? options: dapo, ...

`run.py` runs Hydra with HYDRA_FULL_ERROR=1 so that the exception reaches it (unless the user set
the variable: then Hydra's own report stands).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import sys
from typing import Iterator

EXIT_CONFIG_ERROR = 2

_MISSING_OPTION = re.compile(
    r"Could not find '([^'/]+)/([^']+)'.*?Available options in '[^']+':\s*(.*?)(?:Config search path|$)", re.S
)
_FULL_KEY = re.compile(r"full_key: (\S+)")
_NOT_IN = re.compile(r"Key '([^']+)' not in '([^']+)'")
_SET_IN = re.compile(r"^In '([^']+)'")
_PARSE = re.compile(r"Error parsing override '([^']*)'\s*(.*?)(?:\n|$)")
_CONVERT = re.compile(r"Value '([^']*)' of type '[^']+' could not be converted to (\w+)")


def _closest(word: str, choices: list[str]) -> list[str]:
    return difflib.get_close_matches(word, choices, n=2, cutoff=0.5)


def _chain(exc: BaseException) -> str:
    """The messages of the exception and its causes (Hydra wraps omegaconf's)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def _schema_fields(class_name: str) -> list[str]:
    from rlhf_orch.config import schema

    cls = getattr(schema, class_name, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def one_line(exc: BaseException) -> str:
    """Hydra's composition error in one line naming the key or option and the closest valid ones."""
    text = _chain(exc)
    missing = _MISSING_OPTION.search(text)
    if missing:
        group, option, listed = missing.group(1), missing.group(2), missing.group(3)
        options = [o.strip() for o in listed.split() if o.strip()]
        close = _closest(option, options)
        hint = f"did you mean {' or '.join(f'{group}={c}' for c in close)}? " if close else ""
        return f"{group}={option}: no such option in {group}; {hint}options: {', '.join(options)}"
    parse = _PARSE.search(text)
    if parse:
        override, why = parse.group(1), parse.group(2).strip()
        return f"{override!r} is not an override ({why}): write key=value, group=option, or +key=value for a key that is not in the config"
    key, not_in = _FULL_KEY.search(text), _NOT_IN.search(text)
    if key and not_in:
        full_key, name, owner = key.group(1), not_in.group(1), not_in.group(2)
        parent = full_key.rpartition(".")[0]
        fields = _schema_fields(owner)
        close = _closest(name, fields)
        where = f" in {parent} ({owner})" if parent else ""
        set_in = _SET_IN.search(text)
        origin = f" (set in {set_in.group(1)})" if set_in and set_in.group(1) != "config" else ""
        prefix = f"{parent}." if parent else ""
        hint = f"did you mean {' or '.join(prefix + c for c in close)}? " if close else ""
        listing = f"`python run.py --cfg job` shows every key{' of ' + parent if parent else ''}"
        return f"{full_key}{origin}: no such key{where}; {hint}{listing}"
    convert = _CONVERT.search(text)
    if key and convert:
        return f"{key.group(1)}={convert.group(1)!r}: not a valid {convert.group(2).lower()}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def hydra_errors_in_one_line() -> Iterator[None]:
    """Around `@hydra.main`: its composition errors as one line on stderr and exit 2."""
    if os.environ.get("HYDRA_FULL_ERROR"):
        yield  # the user asked for Hydra's full report
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
