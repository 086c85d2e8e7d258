"""The policy's weights as a sync, a checkpoint export and the tests see them: every weight under
the checkpoint's names (`full`), model.lora's adapters alone under PEFT's names (`adapter`), and
which of the two a weight sync sends (`for_sync`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.trainer.lora import AdapterWeights, MergedLoraWeights
from rlhf_orch.trainer.weight_source import ModuleWeightSource


class PolicyWeights:
    """Views of the policy module's weights (`ModuleWeightSource`'s `metas()` / `gathered()`).

    Without model.lora every weight trains: `full` is the module's parameters and a sync sends
    them. Under model.lora, `full` is the base with the adapters merged in on the fly and a sync
    sends either that ("merged") or the adapter tensors alone ("adapter")."""

    def __init__(self, module: nn.Module, zero_stage: int, lora: LoraSettings | None):
        self.module = module
        self.lora = lora
        self.adapter: AdapterWeights | None = None
        self.lora_views: dict[str, Any] = {}
        if lora is None:
            self.full = ModuleWeightSource(module, zero_stage)
        else:
            self.full = MergedLoraWeights(module, zero_stage)
            self.adapter = AdapterWeights(module, zero_stage)
            self.lora_views = {"adapter": self.adapter, "merged": self.full}

    def for_sync(self, mode: str | None = None):
        """What each weight sync sends. `mode` (model.lora): "adapter" the adapter tensors only,
        "merged" every weight with the adapters merged in (None: model.lora.sync as resolved at
        start -- auto is merged until the engines say what they take)."""
        if mode is None:
            return self.full if self.lora is None else self.lora_views.get(self.lora.sync, self.full)
        if mode not in self.lora_views:
            raise ValueError(f"lora sync mode {mode!r}: one of {sorted(self.lora_views)}")
        return self.lora_views[mode]

    def lora_summary(self) -> dict[str, Any]:
        """What model.lora trains and what a sync moves (the start-up line)."""
        lora = self.lora
        params = list(self.module.parameters())
        numel = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731 (ZeRO-3 keeps the full count here)
        return {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "sync": lora.sync,
            "layers": len(self.adapter.metas()) // 2,
            "trainable": sum(numel(p) for p in params if p.requires_grad),
            "total": sum(numel(p) for p in params),
            "adapter_bytes": sum(m.nbytes for m in self.adapter.metas()),
            "full_bytes": sum(m.nbytes for m in self.full.metas()),
        }
