"""The `env` group's declarations: what a rollout is (`rlhf_orch.env`). The runtime classes extend
them (`rlhf_orch.env.multi_turn.MultiTurnEnv` extends `MultiTurnEnvConfig`, ...), so a default is
written here only.

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING


@dataclass
class EnvConfig:
    """What a rollout is (`rlhf_orch.env`): one response, or a multi-turn trajectory."""

    _target_: str = MISSING

    # Its observations continue the chat template's rendering of the prompt (multi-turn options
    # with observation_format=chat_template).
    continues_chat_template: ClassVar[bool] = False


@dataclass
class SingleTurnEnvConfig(EnvConfig):
    _target_: str = "rlhf_orch.env.single_turn.SingleTurn"


@dataclass
class MultiTurnEnvConfig(EnvConfig):
    """A trajectory: the policy writes, the environment answers, until done or a limit. The whole
    trajectory lives within data.response_max_len tokens."""

    max_turns: int = 4  # model turns per trajectory
    max_tokens_per_turn: Optional[int] = None  # null = the whole data.response_max_len
    max_observation_tokens: int = 256  # longer observations are cut (counted: env/observations_truncated)
    tool_timeout_s: float = 10.0  # one env.step (a tool call) longer than this ends the trajectory, counted
    concurrency: int = 16  # trajectories in flight per engine
    # "last": the last step's reward; "sum": every step's; "per_turn": every step's, each on its turn's
    # last token (for PPO / REINFORCE++, whose advantages read rewards per token)
    reward: str = "last"
    reward_weight: float = 0.0  # + this x the reward group's score of the transcript (0: the environment's alone)
    observation_format: str = "chat_template"  # or "plain" (models whose template renders no tool/user turns)
    # Which part of a too-long observation's content is cut (tail / head / middle); the template's
    # own tokens around it are never cut.
    observation_truncate_side: str = "tail"
    # The context of every trajectory against the chat template's rendering of its conversation
    # (veRL's tokenization sanity check): strict (a mismatch ends the run), warn, off; null: strict
    # with observation_format=chat_template, off with plain (no template to check against).
    tokenization_sanity_check_mode: Optional[str] = None
    stop: list[str] = field(default_factory=list)  # strings that end a turn (kept); the end-of-turn token follows
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    mask_failed: bool = False  # train nothing of a trajectory whose env.step raised or timed out (else: its reward)
    mask_truncated: bool = False  # train nothing of a trajectory cut by a limit (turns, tokens)

    # The environment can reward a turn before the last (env.reward=per_turn then places it there);
    # an option that rewards only its final answer makes per_turn the same as sum.
    rewards_each_turn: ClassVar[bool] = True

    @property
    def continues_chat_template(self) -> bool:
        """Its observations are the chat template's text after a turn: the prompt they follow must be
        the template's rendering too."""
        return self.observation_format == "chat_template"


@dataclass
class CustomEnvConfig(MultiTurnEnvConfig):
    """A user's class with skyrl-gym's BaseTextEnv contract: env.path=<file.py> env.name=<class>."""

    _target_: str = "rlhf_orch.env.custom.CustomEnv"
    path: str = MISSING
    name: str = MISSING
    env_config: dict[str, Any] = field(default_factory=dict)  # passed to the class as env_config


@dataclass
class SkyRLEnvConfig(MultiTurnEnvConfig):
    """A skyrl-gym environment from the installed package: env.env_class=<registered id>."""

    _target_: str = "rlhf_orch.env.skyrl.SkyRLEnv"
    env_class: str = ""  # "" = each row's env_class column
    env_config: dict[str, Any] = field(default_factory=dict)
    # Run skyrl-gym environments that execute the model's code themselves (lcb, searchcode), chosen by
    # env.env_class or by the rows' env_class: in the engine's process, with its environment, network
    # and files, outside rlhf_orch's sandbox; refused before anything starts otherwise. The
    # counterpart of env=python_tool's env.allow_weak_sandbox (which sandboxes the model's code).
    allow_unsandboxed_code: bool = False


@dataclass
class LookupEnvConfig(MultiTurnEnvConfig):
    """The embedded tool-use task's lookup tool (data=lookup, model=tiny_tool)."""

    _target_: str = "rlhf_orch.env.lookup.LookupEnv"
    max_turns: int = 3
    observation_format: str = "plain"

    rewards_each_turn: ClassVar[bool] = False  # a tool call scores 0; the answer is scored


@dataclass
class PythonToolEnvConfig(MultiTurnEnvConfig):
    """The project's tool-calling environment: a sandboxed Python tool (rlhf_orch.env.python_tool)."""

    _target_: str = "rlhf_orch.env.python_tool.PythonToolEnv"
    # "hermes": <tool_call>{json}</tool_call>; "tags": <python>code</python>; or a vLLM tool parser's name
    tool_format: str = "hermes"
    tool_memory_mb: int = 512
    tool_cpu_s: int = 5
    tool_max_output_bytes: int = 2000
    # Run model-written code where the sandbox lacks a boundary (network namespace, private read-only
    # filesystem, separate uid: a host without namespaces, e.g. a default Docker container); refused otherwise.
    allow_weak_sandbox: bool = False

    rewards_each_turn: ClassVar[bool] = False  # a tool call scores 0; the final answer is scored


@dataclass
class AgentEnvConfig(EnvConfig):
    """An agent program calling the run's OpenAI-compatible endpoint: env.path=<file.py> env.name=<function>."""

    _target_: str = "rlhf_orch.env.agent.AgentEnv"
    path: str = MISSING
    name: str = MISSING
    max_tokens_per_turn: Optional[int] = None  # per call; null = the whole data.response_max_len
    max_calls: int = 16  # chat-completions calls per trajectory; later ones are refused (HTTP 400)
    concurrency: int = 16  # agent functions running at once per engine
    timeout_s: float = 120.0  # one agent function, calls included; past it: reward 0, counted
    host: str = "auto"  # where the endpoint listens: auto / loopback (127.0.0.1: the agents run in processes the engine starts), node
    served_model_name: str = "policy"  # the model name agents must ask for (GET /v1/models)
    tool_parser: str = "hermes"  # "hermes": <tool_call>{json}</tool_call> -> tool_calls; "none"; or a vLLM tool parser
    reasoning_parser: str = "none"  # a vLLM reasoning parser (qwen3, deepseek_r1): <think> -> reasoning_content
    # "call": a call's own temperature / top_p / top_k / penalties / seed are honoured (each token trained
    # at its temperature); "run": replaced by the run's, said once and counted (env/sampling_overridden)
    sampling: str = "call"
