"""What every model option gives the rest of the system: a loadable checkpoint location.

Consumers (vLLM engines, DeepSpeed actor/critic/reference ranks) never construct models from the
config themselves; they ask the model option for `path()` and load that with their own loader, so a
locally built tiny model and a Hugging Face checkpoint are interchangeable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class ModelSource(ABC):
    """A policy checkpoint (weights + tokenizer) and the limits it is used under."""

    def __init__(self, context_len: int, dtype: str) -> None:
        if context_len <= 0:
            raise ValueError(f"context_len must be > 0, got {context_len}")
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype!r}")
        self._context_len = context_len
        self._dtype = dtype

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

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, loaded the way the consumers load it."""
        return AutoTokenizer.from_pretrained(self.path())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_id={self.model_id!r}, context_len={self.context_len})"
