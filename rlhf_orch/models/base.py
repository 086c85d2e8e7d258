"""What every model option gives the rest of the system: a loadable checkpoint location.

Consumers (vLLM engines, DeepSpeed actor/critic/reference ranks) never construct models from the
config themselves; they ask the model option for `path()` and load that with their own loader, so a
locally built tiny model and a Hugging Face checkpoint are interchangeable.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_orch.models.hub import ModelSourceError
from rlhf_orch.models.lora import LoraSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Where Hugging Face configs keep the longest sequence the positions cover (the first one present counts).
_POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ModelSource(ABC):
    """A policy checkpoint (weights + tokenizer) and the limits it is used under."""

    def __init__(self, context_len: int, dtype: str, lora: LoraSettings | None = None) -> None:
        if context_len <= 0:
            raise ValueError(f"context_len must be > 0, got {context_len}")
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype!r}")
        self._context_len = context_len
        self._dtype = dtype
        # model.lora: the adapters the policy trains on this base (None: full fine-tuning).
        self.lora = lora if lora is not None and lora.enabled else None

    @property
    def context_len(self) -> int:
        """Longest prompt + response (tokens) the engines and trainers may use."""
        return self._context_len

    @property
    def dtype(self) -> str:
        """Weight dtype the consumers should load with ("float32" on CPU)."""
        return self._dtype

    @property
    @abstractmethod
    def model_id(self) -> str:
        """A short stable name for logs and run metadata."""

    @abstractmethod
    def path(self) -> str:
        """A local directory or hub id that `from_pretrained` and `vllm.LLM(model=...)` accept."""

    def local_dir(self) -> str:
        """The checkpoint's directory on this machine (a hub id resolves to its cached snapshot)."""
        return self.path()

    def check(self) -> None:
        """Refuse (one line) a checkpoint that cannot be had offline, before anything is built
        (a hub id not in the local cache, a package not installed); nothing to refuse by default."""

    def ready(self) -> str:
        """The checkpoint made ready for a run: checked, found or built (the tiny model is built and
        cached on first use), its context length within the checkpoint's positions. Its path."""
        self.check()
        path = self.path()
        self.check_context_len()
        return path

    def check_context_len(self) -> None:
        """Refuse a `context_len` longer than the checkpoint's position limit (config.json): the
        engines would refuse such a max_model_len and the trainers would index past the positions."""
        config = json.loads((Path(self.local_dir()) / "config.json").read_text())
        limits = [(key, config[key]) for key in _POSITION_LIMIT_KEYS if isinstance(config.get(key), int)]
        if limits and self.context_len > limits[0][1]:
            key, limit = limits[0]
            raise ModelSourceError(
                f"model.context_len={self.context_len} exceeds the checkpoint's {key}={limit} "
                f"({self.model_id}): set model.context_len<={limit}"
            )

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, loaded the way the consumers load it. (transformers is
        imported here, not with the module: naming the checkpoint -- `path()` -- needs none of it.)"""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_id={self.model_id!r}, context_len={self.context_len})"
