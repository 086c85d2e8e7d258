"""The prompt type shared by prompt sources and rewards, and the interface of every data option.

`PromptSource` is what the training loop asks of any `data=...` option: `bind` a tokenizer once on the
driver, then draw training prompts with `sample_prompts`, held-out prompts with `eval_prompts`, and
checkpoint the position with `state_dict` / `load_state_dict`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Prompt:
    text: str  # what the policy is conditioned on (templated)
    label: Any = None  # ground truth handed to the reward (str, number, dict or None)
    source: str = "default"  # data_source; metrics are split by it
    extra: Optional[Mapping[str, Any]] = None  # extra_info (veRL layout), handed to custom rewards
    prompt_ids: Optional[tuple[int, ...]] = None
    # The chat messages `text` was rendered from (rows in chat layout); multi-turn environments
    # start from them (`rlhf_orch.env`).
    messages: Optional[tuple[Mapping[str, Any], ...]] = None
    # The row's environment fields (SkyRL's layout: env_class, reward_spec, ...), for `env=skyrl`.
    env_fields: Optional[Mapping[str, Any]] = None
    # Tokens its response runs at least (EOS suppressed until then): the digit task's long-tail
    # length profile (data.long_tail_frac), a pipeline benchmark's shape of reasoning rollouts.
    min_response_len: int = 0


# `eval_prompts(limit)`: every held-out prompt.
ALL_PROMPTS = 0
# The order a prompt source draws in when built without a seed (the config passes the run's `seed`).
DEFAULT_DATA_SEED = 1234


class DataError(ValueError):
    """Bad data input. The message is one line naming the config key and the fix; the app prints it
    and exits with status 2 before Ray starts."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class PromptSource(abc.ABC):
    """The prompts of a run: training prompts (sampled), held-out prompts (fixed), and their state."""

    prompt_max_len: int  # tokens
    response_max_len: int  # tokens
    # The chat template's options beyond the messages, set before `bind` (`render_prompts_with`).
    template_kwargs: Mapping[str, Any] = {}

    def render_prompts_with(self, template_kwargs: Mapping[str, Any]) -> None:
        """Before `bind`: render the prompts' chat template with these options too (a multi-turn
        environment's `env.chat_template_kwargs` -- tools, enable_thinking -- and its fixed date),
        so that data.prompt_max_len measures, and data.overlong acts on, the prompt the policy is
        given. An option whose prompts are raw text renders no template (the config check refuses
        chat-template observations over such prompts)."""
        self.template_kwargs = dict(template_kwargs)

    @abc.abstractmethod
    def bind(self, tokenizer: Any) -> None:
        """Load, template and tokenize. Afterwards every Prompt has `prompt_ids` set (a tuple of ints).

        Raises DataError on bad input.
        """

    @abc.abstractmethod
    def sample_prompts(self, n: int) -> list[Prompt]:
        """The next `n` training prompts (advances the sampler)."""

    @abc.abstractmethod
    def eval_prompts(self, limit: int = ALL_PROMPTS) -> list[Prompt]:
        """Held-out prompts, deterministic: the first `limit` (0 = all); [] without a held-out set."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Plain JSON-able state, so a checkpoint restores the exact sampling position."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by `state_dict`."""

    @property
    @abc.abstractmethod
    def num_train_prompts(self) -> Optional[int]:
        """Training prompts available (None for an infinite generator)."""

    def missing_labels(self) -> int:
        """Training prompts without a label (a rule reward that needs labels refuses to start)."""
        return 0

    def env_field_values(self, name: str) -> set[Any]:
        """The distinct values of a row environment field (SkyRL's `env_class`) over every prompt,
        training and held-out: the environments the rows choose. None for sources without them."""
        return set()

    def describe(self) -> list[str]:
        """Lines worth printing at the start of a run (rows read, rows filtered, ...)."""
        return []
