"""Bucket planning and (un)packing: pure functions shared by every sync strategy and backend.

A bucket is one flat byte buffer holding several parameters back to back. Sender and receiver
derive the same `Bucket` list from the same parameter metadata, so only the metadata crosses
the control plane once per update and the data plane carries raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
import ctypes
import sys
from typing import Iterable, Iterator

import torch

# Offsets are aligned so every view is aligned for any dtype and vectorised copies stay fast.
_ALIGN = 64

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate and name one parameter."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


@dataclass(frozen=True)
class TensorSlot:
    meta: TensorMeta
    offset: int  # byte offset inside the bucket


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    slots: tuple[TensorSlot, ...]

    @property
    def names(self) -> list[str]:
        return [s.meta.name for s in self.slots]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving: fill a bucket until the next tensor would overflow it.

    Order is kept so the receiver sees each layer's tensors together (vLLM's layer-wise reload
    processes a layer as soon as all of its weights arrived). A tensor larger than the bucket
    gets a bucket of its own; bucket boundaries may fall anywhere between tensors, also inside
    a decoder layer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"sync.bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    used = 0
    for meta in metas:
        size = meta.nbytes
        if slots and _aligned(used) + size > bucket_bytes:
            buckets.append(Bucket(len(buckets), used, tuple(slots)))
            slots, used = [], 0
        offset = _aligned(used)
        slots.append(TensorSlot(meta, offset))
        used = offset + size
    if slots:
        buckets.append(Bucket(len(buckets), used, tuple(slots)))
    return buckets


def bucket_capacity(buckets: list[Bucket]) -> int:
    """Bytes a reusable buffer needs to hold any of these buckets."""
    return max((b.nbytes for b in buckets), default=0)


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into `buffer` (uint8, >= bucket.nbytes); returns the used view."""
    for slot in bucket.slots:
        src = tensors[slot.meta.name]
        dst = buffer[slot.offset : slot.offset + slot.meta.nbytes]
        dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
    return buffer[: bucket.nbytes]


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views (no copies) of every tensor in a received bucket buffer."""
    for slot in bucket.slots:
        meta = slot.meta
        raw = buffer[slot.offset : slot.offset + meta.nbytes]
        yield meta.name, raw.view(dtype_from_name(meta.dtype)).view(meta.shape)


def layer_key(name: str) -> str | None:
    """The decoder layer a parameter belongs to ("model.layers.3"), or None outside the layers.

    vLLM processes a layer once all of its weights arrived; layers are keyed by the outermost
    integer segment of the name, like vLLM's own `layerwise_groups`.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def buffer_release_points(buckets: list[Bucket]) -> list[int]:
    """For each bucket, the global tensor position after which its buffer may be reused.

    That is the position of the last tensor of the last layer touching the bucket: until that
    tensor has been handed over, the receiver may still hold views into the bucket. Tensors
    outside the decoder layers (embeddings, final norm, lm_head) may be processed only when the
    reload finishes (a vocabulary padded beyond the checkpoint's rows never "completes"), so
    their buckets are held to the end.
    """
    names = [n for b in buckets for n in b.names]
    end = len(names)
    last_of_layer: dict[str, int] = {}
    for pos, name in enumerate(names):
        key = layer_key(name)
        if key is not None:
            last_of_layer[key] = pos
    points = []
    for b in buckets:
        keys = [layer_key(n) for n in b.names]
        points.append(end if None in keys else max(last_of_layer[k] for k in keys))
    return points


def balanced_owners(buckets: list[Bucket], owners: int) -> list[int]:
    """Which of `owners` senders sends each bucket: least-loaded (in bytes) first, in bucket order.

    Deterministic, so every rank derives the same assignment from the same plan. Consecutive
    buckets go to different senders, so all senders are busy at once from the first bucket on.
    """
    if owners < 1:
        raise ValueError(f"need at least one sender (got {owners})")
    load = [0] * owners
    result = []
    for bucket in buckets:
        owner = min(range(owners), key=lambda s: (load[s], s))
        load[owner] += bucket.nbytes
        result.append(owner)
    return result


_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14  # (linux/mman.h)


def byte_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer of `nbytes` for buckets. In host memory on Linux it is 2 MiB-aligned and
    advised as transparent huge pages (madvise; a no-op where the kernel has them off): a buffer
    allocated for one sync is first touched by its packing or receiving, and 2 MiB page faults
    instead of 4 KiB ones cut that first touch of 256 MiB from ~250 ms to ~75 ms on this machine,
    idle (a buffer already touched: ~50 ms)."""
    if device.type != "cpu" or nbytes < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    try:
        whole_pages = (raw.numel() - start) // _HUGE_PAGE * _HUGE_PAGE  # (those inside the allocation)
        ctypes.CDLL(None).madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(whole_pages), _MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no madvise here: 4 KiB pages
    return raw[start : start + nbytes]


def send_buffers(holder: object, capacity: int, device: torch.device, count: int = 2) -> list[torch.Tensor]:
    """`count` flat byte buffers of at least `capacity` for one update's buckets in flight.

    In host memory each update allocates its own (`byte_buffer`), freed when it ends: kept, they
    were 2 x sync.bucket_mb resident in the sending process through every rollout and training
    phase (0.5 GB of SmolLM2's policy; the engine's receive buffers as much). The price is their
    first touch in every sync: SmolLM2's buckets packed and received (4 x 253 MiB) in 0.36 s into
    kept buffers, 1.55 s into new ones with huge pages, 2.35 s without, on this 2-core machine
    under load (2026-12-02). On a GPU they are kept on `holder` across updates
    (reallocated only when a bigger bucket or another device is needed): a freed CUDA tensor stays
    in torch's caching allocator anyway, and CUDA IPC receivers map the same two buffers again.
    """
    if device.type == "cpu":
        return [byte_buffer(capacity, device) for _ in range(count)]
    cached = getattr(holder, "_sync_send_buffers", None)
    if cached is None or len(cached) < count or cached[0].numel() < capacity or cached[0].device != device:
        cached = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
        holder._sync_send_buffers = cached
    return cached
