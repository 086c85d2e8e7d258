"""`env=skyrl env.env_class=<registered id>`: a skyrl-gym environment from the installed package,
unchanged (`skyrl_gym.make(id, env_config=..., extras=...)`). Rows in SkyRL's parquet layout give
each trajectory its extras: every column but the prompt (`env_class`, `reward_spec`, `extra_info`
and the environment's own: text2sql's `db_id` and `data`, `max_turns`, ...); a row's own
`env_class` wins over `env.env_class`.

`env_config` reaches the environment as SkyRL passes it: a DictConfig (skyrl-gym's environments
read its keys as attributes) holding the environment's own defaults (the `...EnvConfig` dataclass
its module defines: text2sql's `db_path`, search's `search_url`, `topk`, `timeout`) under
`env.env_config.<key>=...` from the command line (no `+` needed).
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, TextEnv, call_env, prompt_messages, row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv
from rlhf_orch.env.options import SkyRLEnvConfig


# skyrl-gym environments that execute the model's code themselves, in the engine's process (its
# environment, network and files), outside this project's sandbox (rlhf_orch.env.sandbox): refused
# before anything starts unless env.allow_unsandboxed_code=true, whether env.env_class or the rows
# choose them. (rlm: a REPL in the process, should a skyrl-gym version register it.)
RUNS_MODEL_CODE = {
    "lcb": "runs the model's code to test it",
    "searchcode": "runs the model's Python",
    "rlm": "runs the model's Python in a REPL",
}
ALLOW_KEY = "env.allow_unsandboxed_code"


def unsandboxed_code_refusal(chosen: dict[str, str]) -> str:
    """Why the environments in `chosen` (id -> what chose it) are refused, with the fix: one line."""
    names = " and ".join(f"{env_id} ({where})" for env_id, where in chosen.items())
    verb = "runs" if len(chosen) == 1 else "run"
    return (
        f"skyrl-gym's {names} {verb} the model's code in the engine's process, with its environment, network and "
        f"files, outside rlhf_orch's sandbox; set {ALLOW_KEY}=true to run it anyway, or train code with "
        "env=python_tool (its code runs in the sandbox)"
    )


def rows_running_model_code(data: Any) -> dict[str, str]:
    """Before Ray: the environments that run the model's code which the rows of `data`'s local
    files choose (their `env_class` column; a hub dataset's rows are checked once loaded, `bind`),
    each with the first file choosing it."""
    from rlhf_orch.data.file_sources import as_file_list, local_column_values

    chosen: dict[str, str] = {}
    for name in ("train_files", "val_files"):
        try:
            specs = as_file_list(getattr(data, name, None), f"data.{name}")
        except ValueError:
            continue  # (the data preparation names the bad entry)
        for i, spec in enumerate(specs):
            key = f"data.{name}[{i}]"
            for env_id in sorted(local_column_values(spec, key, "env_class") or ()):
                if env_id in RUNS_MODEL_CODE:
                    chosen.setdefault(env_id, f"the env_class column of {key}")
    return chosen


def registered_env_ids() -> list[str]:
    from skyrl_gym.envs.registration import registry

    return sorted(registry)


def _entry_point(env_id: str) -> str:
    from skyrl_gym.envs.registration import registry

    return str(getattr(registry[env_id], "entry_point", ""))


def default_env_config(env_id: str) -> dict[str, Any]:
    """The defaults of the `...EnvConfig` dataclass the environment's module defines (none: {})."""
    module_name = _entry_point(env_id).partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return {}
    for name, obj in vars(module).items():
        if name.endswith("EnvConfig") and dataclasses.is_dataclass(obj) and isinstance(obj, type):
            return dataclasses.asdict(obj())
    return {}


def _answers(url: str, timeout_s: float = 3.0) -> bool:
    parsed = urlparse(url)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname or "127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class SkyRLEnv(SkyRLEnvConfig, MultiTurnEnv):
    # What runs the model's code, id -> what chose it (env.env_class, the rows): set by `bind`.
    runs_model_code: dict[str, str] = field(default_factory=dict, init=False)

    @classmethod
    def config_problems(cls, config: Any, data: Any) -> list[tuple[str, Any, str]]:
        """Before Ray (the config check, a dry run included): (key, value, why) when env.env_class
        or the rows of a local data file choose an environment that runs the model's code outside
        the sandbox and env.allow_unsandboxed_code is not set."""
        if config.allow_unsandboxed_code:
            return []
        chosen = _code_running(config.env_class, rows_running_model_code(data))
        return [(ALLOW_KEY, False, unsandboxed_code_refusal(chosen))] if chosen else []

    def bind(self, task: Any) -> None:
        """Every row loaded (hub datasets' too): the environments they choose that run the model's
        code are refused here, before Ray, unless env.allow_unsandboxed_code."""
        super().bind(task)
        rows = {str(c): "the data's env_class column" for c in sorted(task.env_field_values("env_class"), key=str)}
        chosen = _code_running(self.env_class, rows)
        if chosen and not self.allow_unsandboxed_code:
            raise EnvError(f"{ALLOW_KEY}=false: {unsandboxed_code_refusal(chosen)}")
        self.runs_model_code = chosen

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            importlib.import_module("skyrl_gym")
        except ImportError as e:
            raise EnvError("env=skyrl needs the skyrl-gym package: pip install -e '.[envs]'") from e
        if self.env_class and self.env_class not in registered_env_ids():
            raise EnvError(f"env.env_class={self.env_class!r}: skyrl-gym registers {', '.join(registered_env_ids())}")

    def config_for(self, env_class: str) -> DictConfig:
        """env.env_config over the environment's own defaults, as a DictConfig."""
        return OmegaConf.merge(OmegaConf.create(default_env_config(env_class)), OmegaConf.create(dict(self.env_config)))

    def make(self, prompt: Prompt) -> TextEnv:
        import skyrl_gym

        extras = row_extras(prompt)
        env_class = extras.pop("env_class", None) or self.env_class
        if not env_class:
            raise EnvError("env=skyrl: the row has no env_class column and env.env_class is not set")
        return skyrl_gym.make(env_class, env_config=self.config_for(env_class), extras=extras)

    def check(self, prompt: Prompt, tokenizer: Any) -> None:
        """As every multi-turn option, and the services the environment calls answer: search and
        searchcode query a retrieval server (SkyRL's retriever) that this project does not start."""
        self.renderer(tokenizer).observation([{"role": "user", "content": "0"}], True, self.max_observation_tokens)
        try:
            instance = self.make(prompt)
            call_env(instance.init, prompt_messages(prompt))
        except EnvError:
            raise
        except Exception as e:  # one line naming what the environment wanted
            raise EnvError(
                f"env=skyrl: {self._class_of(prompt)} could not start on the first row: {type(e).__name__}: {e}"
            ) from e
        urls = [getattr(g, "search_url", None) for g in getattr(instance, "tool_groups", [])]
        getattr(instance, "close", lambda: None)()
        for url in filter(None, urls):
            if not _answers(url):
                key = (
                    "env.env_config.search_url"
                    if "search_url" in self.config_for(self._class_of(prompt))
                    else "its search_url"
                )
                raise EnvError(
                    f"env=skyrl: {self._class_of(prompt)} queries a retrieval server at {url} ({key}), which does not "
                    "answer; start one (SkyRL's retriever: skyrl-gym's search examples) and set env.env_config.search_url"
                )

    def _class_of(self, prompt: Prompt) -> str:
        return str((prompt.env_fields or {}).get("env_class") or self.env_class)

    def episode_name(self, key: str) -> str:
        """The registered id of the class (`env/text2sql/...`), else its class name."""
        for env_id in registered_env_ids():
            if _entry_point(env_id) == key:
                return env_id
        return super().episode_name(key)

    def describe(self) -> list[str]:
        lines = super().describe()
        for env_id, where in self.runs_model_code.items():
            lines.append(
                f"env: skyrl-gym's {env_id} ({where}) {RUNS_MODEL_CODE[env_id]} in the engine's process, "
                f"outside rlhf_orch's sandbox ({ALLOW_KEY}=true; env=python_tool sandboxes model code)"
            )
        return lines

    def option_name(self) -> str:
        return "skyrl"


def _code_running(env_class: str, chosen_by_rows: dict[str, str]) -> dict[str, str]:
    """Of env.env_class and the environments the rows choose (id -> where), those that run the
    model's code outside the sandbox, each with what chose it (env.env_class first)."""
    chosen = {env_class: "env.env_class"} if env_class in RUNS_MODEL_CODE else {}
    for env_id, where in chosen_by_rows.items():
        if env_id in RUNS_MODEL_CODE:
            chosen.setdefault(env_id, where)
    return chosen
