"""A user's reward function from a Python file, with veRL's `compute_score` signature.

`reward=custom reward.path=my_reward.py reward.name=compute_score` scores with

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

(any subset of those parameters, by name, as veRL's reward managers pass them), or with
`reward.batched=true` the batched form

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]

A dict result is read as its "score" key (veRL lets functions return extra metrics alongside).

The object pickles as (path, name, batched) only: the file is imported lazily, once per process, into
a module cache keyed by the resolved path, because it is shipped to engine actors and pool tasks every
step and re-executing a user's module (which may load a model or open files) per step is not an option.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from rlhf_orch.data.base import Prompt
from rlhf_orch.reward.base import Response, RewardError, RewardFunction

# veRL's keyword names (NaiveRewardManager / BatchRewardManager).
SAMPLE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")

# resolved path -> module; (resolved path, name, batched) -> (function, parameters to pass)
_MODULES: dict[str, ModuleType] = {}
_FUNCTIONS: dict[tuple[str, str, bool], tuple[Callable[..., Any], tuple[str, ...]]] = {}
_LOCK = threading.RLock()


def forget_user_modules() -> None:
    """Import the users' reward files afresh next time (a process kept for another run:
    `VLLMEngine.reset`), as a new process would: a file edited since, or state at module level."""
    with _LOCK:
        _MODULES.clear()
        _FUNCTIONS.clear()


def _one_line(text: str, limit: int = 300) -> str:
    text = " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same_file(a: Optional[str], b: str) -> bool:
    return bool(a) and os.path.realpath(a) == os.path.realpath(b)


def describe_exception(exc: BaseException, path: str) -> str:
    """ "path:line: ExcType: message", with the line of the innermost frame inside the user's file.

    For a SyntaxError in the file, the line is the one the compiler reports. Without any frame in the
    file (the error came from outside it), the line is left out: "path: ExcType: message".
    """
    line: Optional[int] = None
    if isinstance(exc, SyntaxError) and _same_file(exc.filename, path):
        line = exc.lineno
    else:
        for frame in traceback.extract_tb(exc.__traceback__):
            if _same_file(frame.filename, path):
                line = frame.lineno
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    where = f"{path}:{line}" if line is not None else path
    return _one_line(f"{where}: {type(exc).__name__}: {message}")


def _load_module(path: str) -> ModuleType:
    """Import the file once per process (cached by resolved path); RewardError with a one-line message."""
    with _LOCK:
        module = _MODULES.get(path)
        if module is not None:
            return module
        if not os.path.isfile(path):
            raise RewardError(f"reward.path: no such file {path}")
        # A distinct module name per file, registered in sys.modules while it runs (dataclasses and
        # pickling of the user's classes look it up there).
        module_name = "rlhf_orch_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RewardError(f"reward.path: {path} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise RewardError(f"cannot load the reward file: {describe_exception(exc, path)}") from exc
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        _MODULES[path] = module
        return module


def _defined_callables(module: ModuleType) -> list[str]:
    return sorted(
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_") and callable(value) and getattr(value, "__module__", None) == module.__name__
    )


def _parameters_to_pass(fn: Callable[..., Any], expected: tuple[str, ...], where: str) -> tuple[str, ...]:
    """Which of veRL's keyword arguments `fn` declares; RewardError if it needs any other."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{where}: cannot read its signature ({exc})") from exc
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return expected
    passed = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            continue
        if p.name in expected and p.kind is not p.POSITIONAL_ONLY:
            passed.append(p.name)
        elif p.default is p.empty:
            raise RewardError(
                f"{where}: parameter {p.name!r} is not one veRL passes by name ({', '.join(expected)}) "
                f"and has no default"
            )
    return tuple(passed)


def _unwrap(value: Any) -> Any:
    """veRL's dict results carry the reward under "score"; anything else is left for the caller to check."""
    if isinstance(value, Mapping) and "score" in value:
        return value["score"]
    return value


class CustomReward(RewardFunction):
    """A reward from the user's file: `name` in `path`, veRL's signature (see the module docstring)."""

    needs_label = False  # the user's function decides what it needs

    def __init__(self, path: str, name: str, batched: bool = False):
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"reward.path must name the Python file with the reward function, got {path!r}")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"reward.name must name the function in {path}, got {name!r}")
        if not isinstance(batched, bool):
            raise ValueError(f"reward.batched must be true or false, got {batched!r}")
        # Resolved here (in the driver), so actors and pool tasks with another cwd find the same file.
        self.path = str(Path(path).expanduser().resolve())
        self.name = name.strip()
        self.batched = batched

    def _function(self) -> tuple[Callable[..., Any], tuple[str, ...]]:
        key = (self.path, self.name, self.batched)
        cached = _FUNCTIONS.get(key)
        if cached is not None:
            return cached
        with _LOCK:
            module = _load_module(self.path)
            fn = getattr(module, self.name, None)
            if fn is None or not callable(fn):
                defined = ", ".join(_defined_callables(module)) or "none"
                what = "no" if fn is None else "a non-callable"
                raise RewardError(
                    f"reward.name: {self.path} defines {what} {self.name!r}; callables it defines: {defined}"
                )
            expected = BATCH_PARAMS if self.batched else SAMPLE_PARAMS
            params = _parameters_to_pass(fn, expected, f"{self.path}: {self.name}")
            _FUNCTIONS[key] = (fn, params)
            return fn, params

    def check(self) -> None:
        """Import the file and find the function now: RewardError (one line) on any problem."""
        self._function()

    def describe_error(self, exc: BaseException) -> str:
        return describe_exception(exc, self.path)

    def score(self, prompt: Prompt, response: Response) -> Any:
        """The user's result (a dict's "score" taken); execution.py checks it is a finite number."""
        if self.batched:
            return self.score_batch([prompt], [response])[0]
        fn, params = self._function()
        values = {
            "data_source": prompt.source,
            "solution_str": response.text,
            "ground_truth": prompt.label,
            "extra_info": dict(prompt.extra) if prompt.extra is not None else None,
        }
        return _unwrap(fn(**{p: values[p] for p in params}))

    def score_batch(self, prompts: Sequence[Prompt], responses: Sequence[Response]) -> list[Any]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if not self.batched:
            return super().score_batch(prompts, responses)
        fn, params = self._function()
        values = {
            "data_sources": [p.source for p in prompts],
            "solution_strs": [r.text for r in responses],
            "ground_truths": [p.label for p in prompts],
            "extra_infos": [dict(p.extra) if p.extra is not None else None for p in prompts],
        }
        out = fn(**{p: values[p] for p in params})
        if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or len(out) != len(prompts):
            got = f"{len(out)} values" if hasattr(out, "__len__") else repr(out)[:80]
            raise RewardError(
                f"reward {self.name!r} ({self.path}) is batched and must return a list of {len(prompts)} "
                f"scores, got {got}"
            )
        return [_unwrap(v) for v in out]

    def __repr__(self) -> str:
        return f"CustomReward(path={self.path!r}, name={self.name!r}, batched={self.batched})"
