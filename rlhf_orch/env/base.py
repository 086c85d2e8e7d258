"""The `env` group's contract: what a rollout is.

An environment follows skyrl-gym's `BaseTextEnv` contract, so skyrl-gym environments run unchanged
and a user's class needs no import of it:

    env = <class>(env_config=..., extras=...)     # one per trajectory, from the data row
    messages, metadata = env.init(prompt_messages)
    out = env.step(action_text)   # {"observations": [chat messages], "reward": float, "done": bool,
                                  #  "metadata": dict}
    env.close()

`EnvGroup` is what `env=<option>` instantiates: `multi_turn` says whether rollouts are trajectories
(the engines then drive `rlhf_orch.env.turn_driver.runner`), `make(prompt)` builds one trajectory's environment.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol

from rlhf_orch.data.base import Prompt

Message = Mapping[str, Any]  # an OpenAI-format chat message: {"role": ..., "content": ...}


class EnvError(ValueError):
    """A bad environment option or file; one line naming the key and the fix (exit 2 before Ray)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class TextEnv(Protocol):
    """skyrl-gym's `BaseTextEnv`, as this project calls it."""

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def step(self, action: str) -> Mapping[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class StepResult:
    """One `env.step`, checked: what the runner reads of skyrl-gym's step output."""

    observations: list[dict[str, Any]]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    postprocessed_action: str | None = None  # the action as the environment used it (skyrl-gym)

    @staticmethod
    def of(raw: Any) -> "StepResult":
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"env.step must return a mapping (skyrl-gym's BaseTextEnvStepOutput), got {type(raw).__name__}"
            )
        observations = list(raw.get("observations") or [])
        for m in observations:
            if not isinstance(m, Mapping) or "content" not in m:
                raise TypeError(f"env.step observations must be chat messages with 'role' and 'content', got {m!r:.80}")
        reward = float(raw.get("reward") or 0.0)
        action = raw.get("postprocessed_action")
        return StepResult(
            [dict(m) for m in observations],
            reward,
            bool(raw.get("done")),
            dict(raw.get("metadata") or {}),
            None if action is None else str(action),
        )


def prompt_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """The chat messages a prompt was rendered from (rows in chat layout), else one user message."""
    if prompt.messages:
        return [dict(m) for m in prompt.messages]
    return [{"role": "user", "content": prompt.text}]


def row_extras(prompt: Prompt) -> dict[str, Any]:
    """skyrl-gym's `extras` for one row: reward_spec (ground truth = the prompt's label),
    extra_info, and the row's env fields."""
    env_fields = dict(prompt.env_fields or {})
    reward_spec = env_fields.pop("reward_spec", None) or {"method": "rule", "ground_truth": prompt.label}
    extra_info = env_fields.pop("extra_info", None) or prompt.extra or {}  # the row's own column first
    return {**env_fields, "reward_spec": reward_spec, "extra_info": dict(extra_info)}


def call_env(method: Callable[..., Any], *args: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """An environment's `init` / `step`, plain or `async def`: a coroutine runs to completion on
    `loop` (the trajectory's own, so a client made in `init` still works in `step`) in the calling
    thread -- the runner calls each step on a thread of its own, so one environment's await never
    holds the others."""
    result = method(*args)
    if not inspect.isawaitable(result):
        return result
    return loop.run_until_complete(result) if loop is not None else asyncio.run(result)


def is_async(env: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(env, "init", None)) or inspect.iscoroutinefunction(
        getattr(env, "step", None)
    )


def env_class_key(cls: type) -> str:
    """How an environment's class travels to the driver, which aggregates its episode metrics."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass
class TrajectoryCounts:
    """Counters of one trajectory every driver keeps (a rollout's are their sums; the loop divides by
    trajectories); each driver's counters extend them (`EnvCounts`, `AgentCounts`)."""

    trajectories: int = 1
    truncated: int = 0
    observation_tokens: int = 0  # context tokens between model turns (tool results, messages)
    masked: int = 0  # trained on nothing: left out of its group's statistics too

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}


@dataclass(eq=False)
class EnvGroup(abc.ABC):
    """What `env=<option>` builds (picklable: shipped to every engine with each rollout job). The
    options' classes extend their declarations (`rlhf_orch.env.options`) and this."""

    # data.prompt_max_len, taken in `bind`: what env.init may make the prompt (a sequence's first prompt)
    prompt_max_len: int = 0

    multi_turn: ClassVar[bool] = False
    # The model is called from outside through the engine's OpenAI-compatible endpoint (env=agent):
    # the engine runs the whole session on vLLM's thread (`agent_rollout`). Otherwise the engine
    # drives the turns itself, sharing its steps with the other rollouts (`turns`).
    calls_through_endpoint: ClassVar[bool] = False

    def bind(self, task: Any) -> None:
        """On the driver, once the data is loaded: take what the option needs of it."""
        self.prompt_max_len = int(task.prompt_max_len)

    def check(self, prompt: Prompt, tokenizer: Any) -> None:
        """Before Ray: the option works for this prompt and tokenizer (EnvError naming the fix)."""

    def prompt_template_kwargs(self) -> dict[str, Any]:
        """What the chat template must render the data's prompts with beyond their messages, so that
        the prompts are what this option's turns continue (`PromptSource.render_prompts_with`)."""
        return {}

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """A rollout's env counters (summed over its trajectories) as the step's `env/...` metrics."""
        return {}

    def notices(self, metrics: dict[str, float]) -> list[str]:
        """Console lines a step's `env/...` metrics call for (each said once per run, by the driver)."""
        return []

    def make(self, prompt: Prompt) -> TextEnv:
        """This trajectory's environment (multi-turn options only)."""
        raise NotImplementedError(f"{type(self).__name__} makes no environments (single-turn rollouts)")

    def describe(self) -> list[str]:
        return []
