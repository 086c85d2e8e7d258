"""The `sync` group's declarations: how weights move from the trainers to the engines after each
step (`rlhf_orch.sync.per_tensor`, `.bucketed`, `.multi_sender`, `.object_store`, `.cuda_ipc`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING


@dataclass
class SyncConfig:
    """How weights move from trainer rank(s) to every engine after each step.

    The ClassVars are not config keys: they say what each strategy needs, for
    `rlhf_orch.config.checks_run.sync_backend` (no per-strategy branches there).
    """

    _target_: str = MISSING
    backend: str = "gloo"  # "gloo" or "nccl"; honoured, never silently replaced
    timeout_s: float = 120.0

    backends: ClassVar[tuple[str, ...]] = ("gloo", "nccl")  # transports this strategy can use
    needs_colocated_engines: ClassVar[bool] = False  # engine and trainer share a GPU (CUDA IPC)
    min_policy_ranks: ClassVar[int] = 1


@dataclass
class PerTensorSyncConfig(SyncConfig):
    _target_: str = "rlhf_orch.sync.per_tensor.PerTensorBroadcastSync"


@dataclass
class BucketedSyncConfig(SyncConfig):
    _target_: str = "rlhf_orch.sync.bucketed.BucketedBroadcastSync"
    bucket_mb: float = 256.0


@dataclass
class MultiSenderSyncConfig(BucketedSyncConfig):
    """Several policy ranks send at once, each a share of the buckets (or of the engines)."""

    _target_: str = "rlhf_orch.sync.multi_sender.MultiSenderBroadcastSync"
    senders: int = 2  # used: min(senders, placement.actor_ranks)
    shard_by: str = "buckets"  # "buckets" or "engines"

    min_policy_ranks: ClassVar[int] = 2


@dataclass
class ObjectStoreSyncConfig(SyncConfig):
    """Buckets through Ray's object store: no collective group between trainer and engines."""

    _target_: str = "rlhf_orch.sync.object_store.ObjectStoreSync"
    backend: str = "ray"
    bucket_mb: float = 256.0

    backends: ClassVar[tuple[str, ...]] = ("ray",)


@dataclass
class CudaIpcSyncConfig(SyncConfig):
    """Colocated trainer and engine on one GPU: CUDA IPC handles of bucket buffers, no link."""

    _target_: str = "rlhf_orch.sync.cuda_ipc.CudaIpcSync"
    backend: str = "cuda_ipc"
    bucket_mb: float = 512.0

    backends: ClassVar[tuple[str, ...]] = ("cuda_ipc",)
    needs_colocated_engines: ClassVar[bool] = True
