"""Bucketed broadcast: parameters packed into flat buffers of `bucket_mb`, one engine call per update.

The engine opens one layer-wise reload session and consumes buckets as they arrive; the sender
keeps two persistent buffers so packing bucket k+1 overlaps the (asynchronous) broadcast of
bucket k. Under ZeRO-3 parameters are gathered a bucket at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_orch.sync.base import WeightSync
from rlhf_orch.sync.buckets import Bucket, bucket_capacity, pack_bucket, plan_buckets
from rlhf_orch.sync.group import BroadcastGroup


class BucketedBroadcastSync(WeightSync):
    def __init__(self, backend: str = "gloo", timeout_s: float = 120.0, bucket_mb: float = 256.0):
        super().__init__(backend, timeout_s)
        self.bucket_mb = bucket_mb

    def plan(self, weights) -> list[Bucket]:
        return plan_buckets(weights.metas(), int(self.bucket_mb * 2**20))

    def send(self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int) -> dict[str, Any]:
        buckets = self.plan(weights)
        is_sender = rank == 0
        calls = [e.receive_buckets.remote(buckets, [0] * len(buckets), version) for e in engines] if is_sender else []
        buffers = self._send_buffers(weights, bucket_capacity(buckets), group) if is_sender else []
        in_flight = None
        for bucket in buckets:
            with weights.gathered(bucket.names) as tensors:  # collective under ZeRO-3: all ranks
                if not is_sender:
                    continue
                # Pack bucket k into one buffer while bucket k-1 is still on the wire from the other.
                view = pack_bucket(bucket, tensors, buffers[bucket.index % 2])
                if in_flight is not None:
                    in_flight.wait()
                in_flight = group.broadcast(view, 0)
        if in_flight is not None:
            in_flight.wait()
        reports = self._engine_calls(calls, "engines loading the buckets")
        return {
            "bytes": sum(b.nbytes for b in buckets) if is_sender else 0,
            "buckets": len(buckets),
            "engine_load_s": max((r["seconds"] for r in reports), default=0.0),
        }

    @staticmethod
    def _send_buffers(weights, capacity: int, group: BroadcastGroup) -> list[torch.Tensor]:
        # Persistent across updates: a fresh 1 GB allocation per step costs more than the wire.
        cached = getattr(weights, "_bucket_buffers", None)
        if cached is None or cached[0].numel() < capacity:
            cached = [torch.empty(capacity, dtype=torch.uint8, device=group.device) for _ in range(2)]
            weights._bucket_buffers = cached
        return cached
