"""The `data` group's declarations: the prompt sources (`rlhf_orch.data.digit_task`, `.lookup_task`,
`.files`, `.reasoning_gym_task`) and their defaults.

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II, MISSING


@dataclass
class DataConfig:
    """A prompt source (`rlhf_orch.data.base.PromptSource`)."""

    _target_: str = MISSING
    prompt_max_len: int = 32  # tokens
    response_max_len: int = 16  # tokens generated at most
    seed: int = II("seed")  # the order prompts are drawn in; the run's `seed` unless set here

    def raw_prompts(self) -> Optional[str]:
        """Why this option's prompts are not the tokenizer's chat template's rendering of their
        messages (what observations rendered by the template continue), or None when they are.
        The embedded tasks' prompts are raw text (`rev 3 1 4 =`)."""
        return f"data {self._target_.rsplit('.', 1)[-1]} gives raw-text prompts"


@dataclass
class DigitTaskConfig(DataConfig):
    """The embedded verifiable task (see rlhf_orch.data.digit_task)."""

    _target_: str = "rlhf_orch.data.digit_task.DigitReverseTask"
    min_digits: int = 3
    max_digits: int = 5
    filler_tokens: int = 0  # extra context tokens in front of the task (for long-context runs)
    # A long tail of response lengths (pipeline benchmarks): this fraction of training prompts must
    # be answered with at least long_tail_len tokens (EOS suppressed until then). 0 = off.
    long_tail_frac: float = 0.0
    long_tail_len: int = 0
    eval_size: int = 64  # held-out prompts (their own random stream) for evaluation


@dataclass
class LookupTaskConfig(DigitTaskConfig):
    """The embedded tool-use task: the answer is a record's value only the lookup tool returns
    (rlhf_orch.data.lookup_task; with env=lookup and model=tiny_tool)."""

    _target_: str = "rlhf_orch.data.lookup_task.LookupTask"
    # One length: the copy is then a fixed offset back, which a 2-layer model learns in a short
    # warm start (with 3-4 digits it stayed at chance after 300 steps).
    min_digits: int = 3
    max_digits: int = 3
    response_max_len: int = 24  # call + EOS, the tool's answer, the value + EOS


@dataclass
class FilesDataConfig(DataConfig):
    """Prompts from local files (.jsonl, .json, .parquet) or hub datasets (`hf:<name>[:<config>]@<split>`).

    The default column mapping is veRL's parquet layout; OpenRLHF's jsonl takes
    `data.prompt_key=<input key> data.label_key=<label key>`.
    """

    _target_: str = "rlhf_orch.data.files.PromptDataset"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: Optional[str] = "prompt"  # a plain string column or a chat-messages column
    label_key: Optional[str] = "reward_model.ground_truth"  # dots read nested fields
    label_regex: Optional[str] = None  # label = first group of this regex in the label column
    label_columns: Optional[list[str]] = None  # label = {column: value} of these columns instead
    source_key: str = "data_source"
    default_source: str = "default"  # when the source column is absent
    extra_key: str = "extra_info"
    chat_template: bool = True
    prompt_template: Optional[str] = None  # with {prompt} (and any column as {column})
    system_prompt: Optional[str] = None
    overlong: str = "error"  # "error" or "filter"
    shuffle: bool = True
    prompt_max_len: int = 512
    response_max_len: int = 512

    def raw_prompts(self) -> Optional[str]:
        return None if self.chat_template else "data.chat_template=false renders the prompts as plain text"


@dataclass
class ReasoningGymDataConfig(DataConfig):
    """Procedural reasoning tasks from reasoning-gym, scored by the dataset's own verifier
    (rlhf_orch.data.reasoning_gym_task; reward=reasoning_gym)."""

    _target_: str = "rlhf_orch.data.reasoning_gym_task.ReasoningGymTask"
    task: str = MISSING  # a reasoning-gym dataset name: basic_arithmetic, chain_sum, countdown, ...
    task_config: dict[str, Any] = field(default_factory=dict)  # the dataset's own options
    size: int = 100_000  # training entries (generated on demand; the epoch length)
    eval_size: int = 64  # held-out entries (their own seed; never trained on)
    # A name of reasoning-gym's SYSTEM_PROMPTS (default, direct, simple, DeepSeekZero, chain_of_draft),
    # any other text as is, or null for none.
    system_prompt: Optional[str] = "default"
    chat_template: bool = True
    few_shot: int = 0  # solved examples (earlier user/assistant turns) before each question
    prompt_max_len: int = 256
    response_max_len: int = 256

    def raw_prompts(self) -> Optional[str]:
        return None if self.chat_template else "data.chat_template=false renders the prompts as plain text"
