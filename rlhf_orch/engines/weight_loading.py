"""(vLLM worker.) Where received weights go: the sinks a strategy's receive half feeds
(`rlhf_orch.sync.receive.WeightSink`).

`ModelReload` goes through vLLM's own layer-wise reload (`model_runner.reload_weights` with
`is_checkpoint_format=True`, i.e. Hugging Face names; vLLM fuses q/k/v and gate/up itself and
re-packs CPU linear weights): a whole update streams into one reload, or a session is opened once,
fed tensors call by call, and closed. `AdapterReload`: an engine serving the policy's LoRA adapter
(`model.lora.sync=adapter`) takes the same calls, but the tensors of an update replace the served
adapter instead of reloading the base (`rlhf_orch.engines.adapter_serving`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from rlhf_orch.engines.adapter_serving import AdapterUpdate


class ModelReload:
    """The model's weights, reloaded in place by vLLM."""

    def __init__(self, model_runner: Any):
        self.model_runner = model_runner

    def reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()
        self.model_runner.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        refresh_tied_layers(model)

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.get_model().load_weights(tensors)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.model_config)
        refresh_tied_layers(model)


class AdapterReload:
    """The served LoRA adapter, replaced by each update's adapter tensors (the base stays)."""

    def __init__(self, model_runner: Any, adapter_config: dict):
        self.model_runner = model_runner
        self.adapter_config = adapter_config
        self._update: AdapterUpdate | None = None  # the open update's tensors

    def reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        update = AdapterUpdate(self.adapter_config)
        update.add(tensors)
        update.apply(self.model_runner.lora_manager)

    def begin(self) -> None:
        self._update = AdapterUpdate(self.adapter_config)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._update.add(tensors)

    def finish(self) -> None:
        update, self._update = self._update, None
        update.apply(self.model_runner.lora_manager)


class ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's per-update warnings about layers that legitimately receive no checkpoint tensor.

    A tied `lm_head` shares `embed_tokens`' weight (re-processed by `refresh_tied_layers`) and
    rotary embeddings have no weights; vLLM warns about both on every reload.
    """

    _EXPECTED = ("ParallelLMHead: Failed to load weights", "RotaryEmbedding: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(expected in message for expected in self._EXPECTED)


def refresh_tied_layers(model: torch.nn.Module) -> None:
    """Re-run weight post-processing on layers that share a parameter with another layer.

    With tied embeddings vLLM loads only `embed_tokens`; on CPU the tied `lm_head` keeps a
    repacked copy of the old weight for its GEMM, so it must be re-processed after every reload.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and hasattr(module, "quant_method"):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        # The first owner in module order (embed_tokens) is the one the checkpoint names, so the
        # reload already processed it; only the others (lm_head) hold stale repacked copies.
        for module in modules[1:]:
            module.quant_method.process_weights_after_loading(module)
