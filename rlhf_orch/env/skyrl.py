"""`env=skyrl env.env_class=<registered id>`: a skyrl-gym environment from the installed package,
unchanged (`skyrl_gym.make(id, env_config=..., extras=...)`). Rows in SkyRL's parquet layout
(`prompt` messages, `env_class`, `reward_spec`, `extra_info`) give each trajectory its extras; a
row's own `env_class` wins over `env.env_class`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, TextEnv, row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv


def registered_env_ids() -> list[str]:
    from skyrl_gym.envs.registration import registry

    return sorted(registry)


@dataclass
class SkyRLEnv(MultiTurnEnv):
    env_class: str = ""
    env_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            importlib.import_module("skyrl_gym")
        except ImportError as e:
            raise EnvError("env=skyrl needs the skyrl-gym package: pip install -e '.[envs]'") from e
        if self.env_class and self.env_class not in registered_env_ids():
            raise EnvError(f"env.env_class={self.env_class!r}: skyrl-gym registers {', '.join(registered_env_ids())}")

    def make(self, prompt: Prompt) -> TextEnv:
        import skyrl_gym

        extras = row_extras(prompt)
        env_class = extras.pop("env_class", None) or self.env_class
        if not env_class:
            raise EnvError("env=skyrl: the row has no env_class column and env.env_class is not set")
        return skyrl_gym.make(env_class, env_config=dict(self.env_config), extras=extras)

    def option_name(self) -> str:
        return "skyrl"
