"""`env=agent env.path=<file.py> env.name=<function>`: train any agent program that calls an
OpenAI-compatible chat-completions API.

During each rollout every engine serves `/v1/chat/completions` and `/v1/models` (the
`rlhf_orch.env.agent_driver.chat_server`) and runs the agent function once per trajectory
(`rlhf_orch.env.agent_driver.runner`) with a client bound to that trajectory's base URL. Every call's
tokens and log-probs are recorded under the trajectory (`rlhf_orch.env.agent_driver.record`) and the
trajectory trains like any `env` trajectory; its reward is what the function returns.
docs/environments.md ("Agent programs").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from omegaconf import MISSING

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.agent_driver.record import AGENT_METRIC_PREFIX, AgentLimits
from rlhf_orch.env.base import EnvError, EnvGroup, prompt_messages, row_extras
from rlhf_orch.env.agent_driver.chat_api import TOOL_PARSERS
from rlhf_orch.env.reasoning_parsers import check_reasoning_parser
from rlhf_orch.env.tool_parsers import check_tool_parser
from rlhf_orch.env.custom import load_user_module
from rlhf_orch.env.options import AgentEnvConfig

HOSTS = ("auto", "loopback", "node")


def agent_row(prompt: Prompt) -> dict[str, Any]:
    """The data row an agent function gets: the prompt as text and as chat messages, the ground
    truth, and the row's extra fields (veRL's extra_info, SkyRL's env fields)."""
    extras = row_extras(prompt)
    return {
        "prompt": prompt.text,
        "messages": prompt_messages(prompt),
        "ground_truth": extras["reward_spec"].get("ground_truth"),
        "data_source": prompt.source,
        **{k: v for k, v in extras.items() if k != "reward_spec"},
        "reward_spec": extras["reward_spec"],
    }


@dataclass
class AgentEnv(AgentEnvConfig, EnvGroup):
    # The option's keys and their defaults: `AgentEnvConfig`.
    multi_turn: ClassVar[bool] = True  # trajectories: the engines drive them
    # the engine serves the agent's calls (rlhf_orch.engines.agent_rollout)
    calls_through_endpoint: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if MISSING in (self.path, self.name) or not self.path or not self.name:
            raise EnvError("env=agent needs env.path=<file.py> and env.name=<function>")
        check_tool_parser("env.tool_parser", self.tool_parser, TOOL_PARSERS)
        check_reasoning_parser("env.reasoning_parser", self.reasoning_parser)
        if self.host not in HOSTS:
            raise EnvError(f"env.host={self.host!r}: must be one of {', '.join(HOSTS)}")
        self._said: set[str] = set()  # the notices this run's driver has printed (`notices`)

    def load(self) -> Callable[..., Any]:
        """The agent function (its file imported once per process); EnvError naming file and line."""
        module = load_user_module(self.path, "env.path")
        fn = getattr(module, self.name, None)
        if fn is None:
            raise EnvError(f"env.name={self.name!r}: {self.path} defines no {self.name!r}")
        if inspect.isclass(fn) or not callable(fn):
            raise EnvError(
                f"env.name={self.name!r} in {self.path} is not a function: env=agent calls fn(row, client=..., ...)"
            )
        params = list(inspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if not positional:
            raise EnvError(
                f"env.name={self.name!r} in {self.path} takes no positional argument: "
                "it is called as fn(row, client=..., base_url=..., api_key=...)"
            )
        return fn

    def limits(self, response_max_len: int) -> AgentLimits:
        return AgentLimits(
            self.prompt_max_len, response_max_len, self.max_tokens_per_turn or response_max_len, self.max_calls
        )

    def row(self, prompt: Prompt) -> dict[str, Any]:
        return agent_row(prompt)

    def check(self, prompt: Prompt, tokenizer: Any) -> None:
        """Before Ray: the function loads, can travel to the process it runs in (pickled with its
        module by value), and a row for it can be built."""
        from rlhf_orch.env.agent_driver.runner import pickled_function

        fn = self.load()
        try:
            pickled_function(fn)
        except Exception as e:  # what cloudpickle refuses: a lock, a client, a loaded model
            raise EnvError(
                f"env.name={self.name!r} in {self.path} cannot be sent to the process agents run in ({type(e).__name__}: {e}): "
                "create clients, locks and models inside the function (or lazily), not at module level"
            ) from e
        self.row(prompt)

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-trajectory means and counts of the agents' counters (`AgentCounts`), and the
        agents' own metrics as `env/<name>_mean`."""
        n = max(stats.get("trajectories", 0.0), 1.0)
        metrics = {
            "env/calls_mean": stats.get("calls", 0.0) / n,
            "env/unmerged_calls": stats.get("unmerged_calls", 0.0),
            "env/refused_calls": stats.get("refused_calls", 0.0),
            "env/branches": stats.get("branches", 0.0),  # sequences forked from another's history (n > 1, forks)
            "env/greedy_tokens": stats.get("greedy_tokens", 0.0),  # temperature-0 calls' tokens: context only
            # drawn with top-p / top-k / penalties: scored over the whole vocabulary (importance weights correct)
            "env/truncated_sampling_tokens": stats.get("truncated_sampling_tokens", 0.0),
            # ... of which context only: the run weighs no token by the engine's probability
            "env/truncated_sampling_context_tokens": stats.get("truncated_sampling_context_tokens", 0.0),
            "env/sampling_overridden": stats.get("sampling_overridden", 0.0),  # env.sampling=run
            "env/agent_errors": stats.get("agent_errors", 0.0),
            "env/agent_timeouts": stats.get("agent_timeouts", 0.0),
            "env/completion_tokens_mean": stats.get("completion_tokens", 0.0) / n,
            "env/observation_tokens_mean": stats.get("observation_tokens", 0.0) / n,
            "env/truncated": stats.get("truncated", 0.0),
            "env/masked": stats.get("masked", 0.0),  # no model call: trained on nothing, out of the group statistics
            "env/agent_s_mean": stats.get("agent_seconds", 0.0) / n,  # in the agent's own code
            "env/generation_s_mean": stats.get("generation_seconds", 0.0) / n,  # its calls waiting for the engine
        }
        metrics.update(
            {
                f"env/{k[len(AGENT_METRIC_PREFIX) :]}_mean": v / n
                for k, v in stats.items()
                if k.startswith(AGENT_METRIC_PREFIX)
            }
        )
        return metrics

    # (metric, the line said the first step it is non-zero): tokens that did not train as the agent sampled them
    _NOTICES: ClassVar[tuple[tuple[str, str], ...]] = (
        (
            "env/sampling_overridden",
            "env.sampling=run: agents' own sampling settings replaced by the run's (env/sampling_overridden); "
            "env.sampling=call honours them",
        ),
        (
            "env/greedy_tokens",
            "env=agent: calls at temperature 0 are greedy: their tokens are context, not trained on "
            "(env/greedy_tokens); env.sampling=run samples them at the run's temperature",
        ),
        (
            "env/truncated_sampling_context_tokens",
            "env=agent: calls with top_p / top_k / penalties draw from a distribution the trainers do not score: "
            "their tokens are context (env/truncated_sampling_context_tokens) unless algo.tis_cap or algo.decoupled_is_cap "
            "corrects for it; env.sampling=run samples them at the run's settings",
        ),
    )

    def notices(self, metrics: dict[str, float]) -> list[str]:
        lines = []
        for key, line in self._NOTICES:
            if metrics.get(key, 0.0) > 0 and key not in self._said:
                self._said.add(key)
                lines.append(line)
        return lines

    def describe(self) -> list[str]:
        return [
            f"env: agent {self.name} from {self.path}, served as model {self.served_model_name!r}, up to {self.max_calls} calls "
            f"of {self.max_tokens_per_turn or 'up to data.response_max_len'} tokens, {self.concurrency} at once per engine, "
            f"{self.timeout_s:g}s each, sampling settings of the {'calls' if self.sampling == 'call' else 'run'}"
        ]
