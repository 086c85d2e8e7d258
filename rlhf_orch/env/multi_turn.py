"""What every multi-turn `env` option shares: its limits, how its rewards add up, what it refuses."""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, EnvGroup, call_env, prompt_messages
from rlhf_orch.env.turn_driver import abandonable
from rlhf_orch.env.options import MultiTurnEnvConfig
from rlhf_orch.env.observations import CHECK_MODES, FORMATS, TRUNCATE_SIDES, FixedClock, ObservationRenderer
from rlhf_orch.env.turn_driver.trajectory import Trajectory, TrajectoryLimits

REWARDS = ("last", "sum", "per_turn")


def average_metrics(metrics: Sequence[dict]) -> dict[str, float]:
    """skyrl-gym's default aggregation: the mean of each numeric key over the episodes."""
    values: dict[str, list[float]] = {}
    for m in metrics:
        for k, v in m.items():
            if isinstance(v, (bool, int, float)):
                values.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in values.items()}


@dataclass
class MultiTurnEnv(MultiTurnEnvConfig, EnvGroup):
    """Base of `env=custom`, `env=skyrl`, `env=python_tool` (their declarations: rlhf_orch.env.options).

    The trajectory's reward is the environment's (`reward`: the last step's, or the sum of every
    step's; `per_turn`: the sum, each step's reward also placed on its turn's last token for the
    estimators that read rewards per token, PPO and REINFORCE++) plus `reward_weight` x the `reward` group's score of the final transcript (the decoded
    response: every turn and observation); `reward_weight: 0` leaves the reward group out.
    """

    # The option's keys and their defaults: `MultiTurnEnvConfig`.
    # The run's instant for templates that stamp today's date (`FixedClock`): taken where the option
    # is built (the driver), travelling with it to the engines. 0: now.
    template_time: float = 0.0

    multi_turn: ClassVar[bool] = True
    # The engine's tokenizer, set where trajectories run (`attach`): what environments that read
    # special tokens (vLLM's tool parsers) need. None on the driver.
    engine_tokenizer = None  # (a class attribute, not a config field)

    @property
    def places_turn_rewards(self) -> bool:
        """Each trajectory carries its turns' rewards per token (`TURN_REWARDS`)."""
        return self.reward == "per_turn"

    def attach(self, tokenizer: Any) -> None:
        self.engine_tokenizer = tokenizer

    def __post_init__(self) -> None:
        self.stop = [str(s) for s in self.stop or []]
        self.template_time = self.template_time or time.time()
        if self.observation_format == "plain" and self.tokenization_sanity_check_mode not in (None, "off"):
            # nothing to check against: refused rather than silently ignored
            raise EnvError(
                f"env.tokenization_sanity_check_mode={self.tokenization_sanity_check_mode}: checks contexts against "
                "the chat template, which env.observation_format=plain does not use; leave it unset"
            )
        if self.tokenization_sanity_check_mode is None:
            self.tokenization_sanity_check_mode = "strict" if self.observation_format == "chat_template" else "off"
        self.chat_template_kwargs = dict(self.chat_template_kwargs or {})
        for key, value, allowed in (
            ("reward", self.reward, REWARDS),
            ("observation_format", self.observation_format, FORMATS),
            ("observation_truncate_side", self.observation_truncate_side, TRUNCATE_SIDES),
            ("tokenization_sanity_check_mode", self.tokenization_sanity_check_mode, CHECK_MODES),
        ):
            if value not in allowed:
                raise EnvError(f"env.{key}={value!r}: must be one of {', '.join(allowed)}")
        if any(not s for s in self.stop):
            raise EnvError("env.stop: an empty stop string would end every turn at once; remove it")
        if self.observation_format == "plain" and self.chat_template_kwargs:
            raise EnvError(
                "env.chat_template_kwargs: env.observation_format=plain renders no chat template; remove them"
            )

    def renderer(self, tokenizer: Any, stop_ids: Any = ()) -> ObservationRenderer:
        """How this option's observations become tokens for `tokenizer` (`stop_ids`: the engine's
        end-of-turn ids beyond the tokenizer's EOS, from the model's generation config)."""
        return ObservationRenderer(
            tokenizer,
            self.observation_format,
            self.observation_truncate_side,
            stop_ids,
            self.chat_template_kwargs,
            FixedClock(self.template_time),
        )

    def prompt_template_kwargs(self) -> dict[str, Any]:
        if self.observation_format != "chat_template":
            return {}
        return {**self.chat_template_kwargs, "strftime_now": FixedClock(self.template_time)}

    def action_decoder(self, tokenizer: Any, stop_ids: Sequence[int] = ()) -> Callable[[Sequence[int]], str] | None:
        """How a model turn's tokens become the `action` env.step reads where this option reads more
        than skyrl-gym's contract gives (its text without special tokens: None)."""
        return None

    def limits(self, response_max_len: int) -> TrajectoryLimits:
        per_turn = self.max_tokens_per_turn or response_max_len
        return TrajectoryLimits(
            self.max_turns, per_turn, response_max_len, self.max_observation_tokens, self.prompt_max_len
        )

    def check(self, prompt: Prompt, tokenizer: Any) -> None:
        """The observation format renders with this tokenizer; the environment starts for `prompt`
        within the deadline every environment call has (a hung start is refused, not waited for)."""
        renderer = self.renderer(tokenizer)
        renderer.observation([{"role": "user", "content": "0"}], True, self.max_observation_tokens)
        if self.tokenization_sanity_check_mode == "strict" and not renderer.renders_turns_alike():
            raise EnvError(
                "env.tokenization_sanity_check_mode=strict: this tokenizer's chat template renders the last assistant turn "
                "otherwise than earlier ones (Qwen3: a <think> block the turn loses once a message follows it), so no context "
                "kept as generated can match its rendering of the conversation and strict would end the run at the first "
                "trajectory; set env.tokenization_sanity_check_mode=warn (differences counted in env/tokenization_mismatches) or off"
            )
        deadline = self.step_timeout_s()
        started = abandonable.start(self._start_and_close, prompt, name="env-check")
        try:
            started.result(timeout=deadline)
        except cf.TimeoutError:
            abandonable.abandon(started)
            raise EnvError(
                f"env.tool_timeout_s={self.tool_timeout_s:g}: starting the environment for the first prompt (env.make, env.init) "
                f"took longer than {deadline:g}s; make it start faster (or raise env.tool_timeout_s)"
            ) from None

    def _start_and_close(self, prompt: Prompt) -> None:
        instance = self.make(prompt)
        call_env(instance.init, prompt_messages(prompt))
        getattr(instance, "close", lambda: None)()

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-trajectory means and counts of the runner's counters (`EnvCounts`)."""
        n = max(stats.get("trajectories", 0.0), 1.0)
        return {
            "env/turns_mean": stats.get("turns", 0.0) / n,
            "env/tool_calls_mean": stats.get("tool_calls", 0.0) / n,
            "env/tool_errors": stats.get("tool_errors", 0.0),
            "env/tool_timeouts": stats.get("tool_timeouts", 0.0),
            "env/step_errors": stats.get("env_errors", 0.0),
            "env/step_timeouts": stats.get("env_timeouts", 0.0),
            "env/init_timeouts": stats.get("init_timeouts", 0.0),
            "env/close_timeouts": stats.get("close_timeouts", 0.0),
            "env/truncated": stats.get("truncated", 0.0),
            "env/observation_tokens_mean": stats.get("observation_tokens", 0.0) / n,
            "env/observations_truncated": stats.get("observations_truncated", 0.0),
            "env/observations_too_long": stats.get("observations_too_long", 0.0),
            "env/closing_tokens_added": stats.get("closing_tokens_added", 0.0),
            "env/tokenization_mismatches": stats.get("tokenization_mismatches", 0.0),
            "env/postprocessed_actions": stats.get("postprocessed_actions", 0.0),
            "env/masked": stats.get("masked", 0.0),
            "time/env": stats.get("env_seconds", 0.0),
        }

    def masks_out(self, t: Trajectory) -> bool:
        """Train nothing of this trajectory: its environment failed (an error or a timeout in
        env.step, a timeout starting it: `env.mask_failed`), or a limit cut it (`env.max_turns`, a token budget:
        `env.mask_truncated`) -- instead of training it with the reward it ended with (rLLM;
        SkyRL's overlong filtering). A trajectory whose environment never started (`init_timeouts`)
        has nothing to train whatever the keys: always masked, so its reward 0 -- the
        infrastructure's, not the policy's -- stays out of its group's statistics too."""
        if t.counts.init_timeouts:
            return True
        failed = t.counts.env_errors + t.counts.env_timeouts > 0
        cut = (t.truncated and not failed) or t.last_turn_hit_length
        return (self.mask_failed and failed) or (self.mask_truncated and cut)

    def aggregate(self, episodes: list[tuple[str, dict]]) -> dict[str, float]:
        """The environments' own episode metrics (skyrl-gym's `get_metrics`), aggregated by each
        environment class's `aggregate_metrics` (else averaged), as `env/<name>/<key>`."""
        by_class: dict[str, list[dict]] = {}
        for key, metrics in episodes:
            by_class.setdefault(key, []).append(metrics)
        out: dict[str, float] = {}
        for key, metrics in by_class.items():
            cls = self.episode_class(key)
            try:
                aggregated = (getattr(cls, "aggregate_metrics", None) or average_metrics)(metrics) or {}
            except Exception:  # e.g. an instance method: the mean, as skyrl-gym's default
                aggregated = average_metrics(metrics)
            for name, value in aggregated.items():
                if isinstance(value, (int, float)):
                    out[f"env/{self.episode_name(key)}/{name}"] = float(value)
        return out

    def episode_class(self, key: str) -> Any:
        """The class an `env_class_key` names (None where it cannot be imported here)."""
        module, _, qualname = key.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError):
            return None

    def episode_name(self, key: str) -> str:
        return key.rpartition(":")[2].rpartition(".")[2]

    def step_timeout_s(self) -> float:
        """How long one env.step may take before the trajectory ends (counted as env/step_timeouts)."""
        return self.step_wait_s(self.tool_timeout_s)

    @classmethod
    def step_wait_s(cls, tool_timeout_s: float) -> float:
        """The longest one env.step may take with `env.tool_timeout_s` (the config check reads it: no
        engine step is made meanwhile)."""
        return tool_timeout_s

    def option_name(self) -> str:
        return type(self).__name__

    def describe(self) -> list[str]:
        per_turn = f"{self.max_tokens_per_turn} tokens" if self.max_tokens_per_turn else "the response budget"
        return [
            f"env: {self.option_name()}, up to {self.max_turns} turns of {per_turn}, "
            f"reward={self.reward}" + (f" + {self.reward_weight:g} x reward group" if self.reward_weight else "")
        ]
