"""A Hugging Face checkpoint (local directory or hub id), used as is."""

from __future__ import annotations

from rlhf_orch.models.base import ModelSource


class HFModel(ModelSource):
    """A pretrained checkpoint; the consumers load `name_or_path` themselves."""

    def __init__(self, context_len: int, dtype: str, name_or_path: str) -> None:
        super().__init__(context_len, dtype)
        if not name_or_path:
            raise ValueError("name_or_path must name a local directory or a hub id")
        self.name_or_path = name_or_path

    @property
    def model_id(self) -> str:
        return self.name_or_path

    def path(self) -> str:
        # Not resolved here: each consumer (vLLM, transformers) has its own download/cache logic,
        # and resolving on the driver would download the weights to the wrong machine.
        return self.name_or_path
