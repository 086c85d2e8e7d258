"""A Hugging Face checkpoint (local directory or hub id), used as is."""

from __future__ import annotations

from rlhf_orch.models.base import ModelSource
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.models.hub import check_model_source, resolve_local_checkpoint


class HFModel(ModelSource):
    """A pretrained checkpoint; the consumers load `name_or_path` themselves."""

    def __init__(self, context_len: int, dtype: str, name_or_path: str, lora: LoraSettings | None = None) -> None:
        super().__init__(context_len, dtype, lora)
        if not name_or_path:
            raise ValueError("name_or_path must name a local directory or a hub id")
        self.name_or_path = name_or_path

    @property
    def model_id(self) -> str:
        return self.name_or_path

    def path(self) -> str:
        # Not resolved to a snapshot directory: each consumer (vLLM, transformers) has its own
        # cache logic and may run on another node. `check()` proves it loads before Ray starts.
        return self.name_or_path

    def local_dir(self) -> str:
        return resolve_local_checkpoint(self.name_or_path, "model.name_or_path")

    def check(self) -> None:
        """Refuse (one line) a hub id that is neither a local directory nor in the local HF cache
        (the same check the app makes on the config before its heavy imports)."""
        check_model_source(self)
