"""`env=custom env.path=<file.py> env.name=<class>`: a user's environment class with skyrl-gym's
`BaseTextEnv` contract (no import of skyrl-gym needed). The file is imported once per process
(cached by resolved path), like `reward=custom`; load errors name the file and line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from omegaconf import MISSING, OmegaConf

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, TextEnv, row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv
from rlhf_orch.env.options import CustomEnvConfig
from rlhf_orch.reward.custom import describe_exception

_MODULES: dict[str, ModuleType] = {}
_LOCK = threading.Lock()


def forget_user_modules() -> None:
    """Import the users' environment files afresh next time (a process kept for another run)."""
    with _LOCK:
        _MODULES.clear()


def load_user_module(path: str, key: str) -> ModuleType:
    """The user's file `path` (imported once per process); EnvError naming `key`, the file and line."""
    resolved = os.path.realpath(path)
    with _LOCK:
        module = _MODULES.get(resolved)
        if module is None:
            if not os.path.isfile(resolved):
                raise EnvError(f"{key}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"rlhf_orch_user_env_{abs(hash(resolved))}", resolved)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # any error in the user's file, in one line
                sys.modules.pop(spec.name, None)
                raise EnvError(f"{key}: importing failed: {describe_exception(e, resolved)}") from e
            _MODULES[resolved] = module
    return module


def load_env_class(path: str, name: str) -> type:
    """The class `name` of file `path` (imported once per process); EnvError naming file and line."""
    module = load_user_module(path, "env.path")
    cls = getattr(module, name, None)
    if cls is None:
        raise EnvError(f"env.name={name!r}: {path} defines no {name!r}")
    missing = [m for m in ("init", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(
            f"env.name={name!r} in {path} has no {' / '.join(missing)}: an environment needs init(prompt) and step(action)"
        )
    return cls


@dataclass
class CustomEnv(CustomEnvConfig, MultiTurnEnv):
    def __post_init__(self) -> None:
        super().__post_init__()
        if MISSING in (self.path, self.name) or not self.path or not self.name:
            raise EnvError("env=custom needs env.path=<file.py> and env.name=<class>")

    def load(self) -> type:
        return load_env_class(self.path, self.name)

    def make(self, prompt: Prompt) -> TextEnv:
        cls = self.load()
        try:
            # a DictConfig, as SkyRL passes it: keys read as attributes or items
            return cls(env_config=OmegaConf.create(dict(self.env_config)), extras=row_extras(prompt))
        except Exception as e:
            raise EnvError(
                f"env=custom: {self.name}(env_config=..., extras=...) failed: {describe_exception(e, os.path.realpath(self.path))}"
            ) from e

    def episode_class(self, key: str) -> Any:
        """The user's class (its module is loaded from env.path, not importable by name)."""
        return self.load() if key.rpartition(":")[2] == self.name else super().episode_class(key)

    def option_name(self) -> str:
        return "custom"
