"""Methods mixed into every vLLM worker (`worker_extension_cls`): receive weights and reload them.

Reloading goes through vLLM's own layer-wise reload (`model_runner.reload_weights` with
`is_checkpoint_format=True`, i.e. Hugging Face names; vLLM fuses q/k/v and gate/up itself and
re-packs CPU linear weights). Bucketed updates stream: the weights iterator handed to vLLM
receives bucket k+1 from the group while vLLM processes the layers completed by bucket k.
Per-tensor updates open the same layer-wise session once, feed one tensor per call, and close it.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from rlhf_orch.sync.buckets import (
    Bucket,
    TensorMeta,
    bucket_capacity,
    buffer_release_points,
    dtype_from_name,
    unpack_bucket,
)
from rlhf_orch.sync.group import BroadcastGroup, GroupAddress


class _ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's per-update warnings about layers that legitimately receive no checkpoint tensor.

    A tied `lm_head` shares `embed_tokens`' weight (re-processed by `refresh_tied_layers`) and
    rotary embeddings have no weights; vLLM warns about both on every reload.
    """

    _EXPECTED = ("ParallelLMHead: Failed to load weights", "RotaryEmbedding: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(expected in message for expected in self._EXPECTED)


class WeightSyncWorkerExtension:
    """Mixin: `self` is a vLLM Worker (has `model_runner`, `rank`)."""

    # ------------------------------------------------------------------ group
    def rlhf_join_weight_group(self, address: GroupAddress, rank_offset: int) -> int:
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings())
        rank = rank_offset + self.rank
        self._rlhf_group = BroadcastGroup(address, rank)
        return rank

    def _rlhf_pool(self, capacity: int) -> ReceiveBufferPool:
        # Receive buffers persist across updates: allocating ~1 GB per step costs more than the wire.
        pool = getattr(self, "_rlhf_buffer_pool", None)
        if pool is None or pool.capacity < capacity:
            pool = ReceiveBufferPool(capacity, self._rlhf_group.device)
            self._rlhf_buffer_pool = pool
        return pool

    # ------------------------------------------------------------------ bucketed
    def rlhf_receive_buckets(self, buckets: list[Bucket], src_of_bucket: list[int]) -> int:
        """Receive every bucket (bucket i broadcast by rank src_of_bucket[i]) and reload."""
        group = self._rlhf_group
        pool = self._rlhf_pool(bucket_capacity(buckets))
        release_after = buffer_release_points(buckets)
        received = {"bytes": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            position = 0
            for bucket in buckets:
                buf = pool.acquire()[: bucket.nbytes]
                group.broadcast(buf, src_of_bucket[bucket.index]).wait()
                received["bytes"] += bucket.nbytes
                pool.hold(buf, release_after[bucket.index])
                for item in unpack_bucket(bucket, buf):
                    yield item
                    # vLLM processes a layer inside load_weights as soon as its last tensor
                    # arrived, so once we are asked for the next tensor, earlier layers are done.
                    pool.release_through(position)
                    position += 1
            pool.release_through(position)

        model = self.model_runner.get_model()
        self.model_runner.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
        refresh_tied_layers(model)
        return received["bytes"]

    # ------------------------------------------------------------------ per tensor
    def rlhf_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def rlhf_receive_tensor(self, meta: TensorMeta, src: int = 0) -> int:
        tensor = torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype), device=self._rlhf_group.device)
        self._rlhf_group.broadcast(tensor, src).wait()
        self.model_runner.get_model().load_weights([(meta.name, tensor)])
        return meta.nbytes

    def rlhf_finish_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.model_config)
        refresh_tied_layers(model)

    # ------------------------------------------------------------------ checks
    def rlhf_weight_checksum(self) -> float:
        """Sum of all parameters as the engine holds them (cheap 'did anything change' probe)."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.get_model().parameters()))


class ReceiveBufferPool:
    """Reusable receive buffers whose views vLLM may still hold.

    vLLM's layer-wise reload keeps references to the tensors it was given until every weight of
    that layer arrived, so a bucket's buffer can be reused only after the generator moved past
    the last tensor of every layer that has a tensor in it (`buffer_release_points`). With
    buckets at least one layer large this needs two or three buffers, allocated once.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.device = device
        self._free: list[torch.Tensor] = []
        self._held: list[tuple[int, torch.Tensor]] = []
        self.allocated = 0

    def acquire(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return torch.empty(self.capacity, dtype=torch.uint8, device=self.device)

    def hold(self, view: torch.Tensor, release_after_position: int) -> None:
        self._held.append((release_after_position, view))

    def release_through(self, position: int) -> None:
        still_held = []
        for release_at, view in self._held:
            if release_at < position:
                # Return the whole underlying buffer, not the bucket-sized view.
                self._free.append(torch.empty(0, dtype=torch.uint8, device=self.device).set_(view.untyped_storage()))
            else:
                still_held.append((release_at, view))
        self._held = still_held


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
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
