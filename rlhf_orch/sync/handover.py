"""Buckets handed to the engines without a collective group: one engine call per bucket.

Used where no broadcast group exists or none is needed: the Ray object store (clusters where
no gloo/NCCL group can be formed) and CUDA IPC (trainer and engine share one GPU). Planning,
packing, the two persistent sender buffers and the engine's reload session are the ones the
broadcast strategies use; a subclass only says how a packed buffer is published (`publish`)
and the payload it returns says how the engine copies it out (`copy_into`).

Pipelining: the call for bucket k is issued and the sender goes on packing bucket k+1; before
packing into a buffer again it waits for the engines' calls of the bucket that used it last,
so at most two buckets are in flight and the sender's buffers are never overwritten early.
"""

from __future__ import annotations

import abc
import time
from collections import deque
from typing import Any

import torch

from rlhf_orch.sync.base import GroupSpec, WeightSync
from rlhf_orch.sync.buckets import Bucket, bucket_capacity, pack_bucket, plan_buckets, reusable_buffers
from rlhf_orch.sync.group import BroadcastGroup

_SEND_BUFFERS = 2


class HandoverSync(WeightSync):
    #: The one transport a hand-over strategy has; `sync.backend` must name it.
    transport: str

    def __init__(self, backend: str, timeout_s: float = 120.0, bucket_mb: float = 256.0):
        if backend != self.transport:
            raise ValueError(
                f"sync.backend={backend!r}: {type(self).__name__} has one transport, {self.transport!r}"
            )
        super().__init__(backend, timeout_s)
        self.bucket_mb = bucket_mb

    def group_specs(self, policy_ranks: int, engines: int) -> list[GroupSpec]:
        return []  # nothing to form: buckets travel as Ray call arguments

    def plan(self, weights) -> list[Bucket]:
        return plan_buckets(weights.metas(), int(self.bucket_mb * 2**20))

    @abc.abstractmethod
    def buffer_device(self) -> torch.device:
        """Where the sender packs (the trainer's device for IPC, host memory for the object store)."""

    @abc.abstractmethod
    def publish(self, packed: torch.Tensor) -> Any:
        """A picklable payload (see worker_extension.BucketPayload) giving engines this bucket's bytes."""

    def send(self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int) -> dict[str, Any]:
        buckets = self.plan(weights)
        lead = rank == 0  # one sender; other ranks only join ZeRO-3 gathers
        capacity = bucket_capacity(buckets)
        stats = {"pack_s": 0.0, "publish_s": 0.0, "engine_wait_s": 0.0}
        if lead:
            self._engine_calls([e.begin_update.remote(buckets) for e in engines], "opening the engines' reload session")
            buffers = reusable_buffers(weights, capacity, self.buffer_device(), _SEND_BUFFERS)
        in_flight: deque[list] = deque()
        for bucket in buckets:
            with weights.gathered(bucket.names) as tensors:  # collective under ZeRO-3: every rank
                if not lead:
                    continue
                if len(in_flight) == _SEND_BUFFERS:
                    t0 = time.perf_counter()
                    self._engine_calls(in_flight.popleft(), f"engines loading bucket {bucket.index - _SEND_BUFFERS}")
                    stats["engine_wait_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                packed = pack_bucket(bucket, tensors, buffers[bucket.index % _SEND_BUFFERS])
                t1 = time.perf_counter()
                payload = self.publish(packed)
                t2 = time.perf_counter()
                stats["pack_s"] += t1 - t0
                stats["publish_s"] += t2 - t1
                in_flight.append([e.load_bucket.remote(bucket, payload, capacity) for e in engines])
        if not lead:
            return {"bytes": 0}
        t0 = time.perf_counter()
        while in_flight:
            self._engine_calls(in_flight.popleft(), "engines loading the last buckets")
        stats["engine_wait_s"] += time.perf_counter() - t0
        reports = self._engine_calls([e.finish_update.remote(version) for e in engines], "closing the reload session")
        return {
            "bytes": sum(b.nbytes for b in buckets),
            "buckets": len(buckets),
            "engine_finish_s": max(r["seconds"] for r in reports),
            **stats,
        }
