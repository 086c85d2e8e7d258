"""Bucketed broadcast: parameters packed into flat buffers of `bucket_mb`, one engine call per update.

Both halves: the sender (`BucketedBroadcastSync.send`, in the policy ranks) and the engine's receive
(`ReceiveBuckets`, in every vLLM worker). The engine streams the buckets into one layer-wise reload
as they arrive, already receiving the next bucket while vLLM loads the current one. The sender packs into two
buffers so packing bucket k+1 overlaps the (asynchronous) broadcast of bucket k (`send_buffers`:
in host memory held for the update only, on a GPU kept across updates). Under ZeRO-3
parameters are gathered a bucket at a time.

The multi-sender strategy (`multi_sender.py`) is this class with more than one group: it only
changes which sender broadcasts which bucket to which engine (`route`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch

from rlhf_orch.sync.base import WeightSync
from rlhf_orch.sync.buckets import (
    Bucket,
    bucket_capacity,
    buffer_release_points,
    pack_bucket,
    plan_buckets,
    send_buffers,
)
from rlhf_orch.sync.group import BroadcastGroup
from rlhf_orch.sync.receive import EngineStep, WorkerReceiver

# Sender buffers: one being packed while the other is on the wire.
_SEND_BUFFERS = 2


class BucketedBroadcastSync(WeightSync):
    #: False only in the benchmark's transport profile (engines receive but skip vLLM's load).
    engine_loads: bool = True

    def __init__(self, *, backend: str, timeout_s: float, bucket_mb: float):
        super().__init__(backend=backend, timeout_s=timeout_s)
        self.bucket_mb = bucket_mb

    def send_buffers(self, policy_ranks: int, engines: int, on_gpu: bool) -> dict[int, int]:
        # Each sender packs `_SEND_BUFFERS` buckets in flight: NCCL broadcasts from CUDA buffers,
        # gloo from host memory (on a GPU layout not planned: the GPUs are).
        if on_gpu and self.backend != "nccl":
            return {}
        return {
            spec.sender: _SEND_BUFFERS * int(self.bucket_mb * 2**20) for spec in self.group_specs(policy_ranks, engines)
        }

    # ------------------------------------------------------------------ routing (overridden by multi-sender)
    def plan(self, weights) -> list[Bucket]:
        return plan_buckets(weights.metas(), int(self.bucket_mb * 2**20))

    def route(self, buckets: list[Bucket], engines: int) -> list[list[int]]:
        """route[e][i]: index of the group spec (= sender) that delivers bucket i to engine e."""
        return [[0] * len(buckets) for _ in range(engines)]

    def receive_ahead(self) -> int:
        """Buckets an engine receives ahead of the one vLLM is loading."""
        return 1

    # ------------------------------------------------------------------ sender side
    def send(
        self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int
    ) -> dict[str, Any]:
        buckets = self.plan(weights)
        specs = self._specs  # formed by prepare() on the driver; travels with this object
        route = self.route(buckets, len(engines))
        mine = {i for e, row in enumerate(route) for i, s in enumerate(row) if specs[s].sender == rank}
        calls = []
        if rank == 0:
            # The lead rank tells every engine, once, which group each bucket arrives on.
            for e, engine in enumerate(engines):
                routes = [(specs[s].name, 0) for s in route[e]]
                step = ReceiveBuckets(buckets, routes, version, self.receive_ahead(), self.engine_loads)
                calls.append(engine.receive_weights.remote(step))
        stats = {"pack_s": 0.0, "wire_wait_s": 0.0, "gather_s": 0.0}
        buffers = (
            send_buffers(weights, bucket_capacity([buckets[i] for i in mine]), group.device, _SEND_BUFFERS)
            if mine
            else []
        )
        in_flight: deque = deque()
        sent = 0
        for bucket in buckets:
            t0 = time.perf_counter()
            with weights.gathered(bucket.names) as tensors:  # collective under ZeRO-3: every rank
                stats["gather_s"] += time.perf_counter() - t0
                if bucket.index not in mine:
                    continue
                if len(in_flight) == _SEND_BUFFERS:
                    # The buffer about to be packed is the one of the oldest broadcast.
                    t1 = time.perf_counter()
                    in_flight.popleft().wait()
                    stats["wire_wait_s"] += time.perf_counter() - t1
                t1 = time.perf_counter()
                view = pack_bucket(bucket, tensors, buffers[sent % _SEND_BUFFERS])
                stats["pack_s"] += time.perf_counter() - t1
                in_flight.append(group.broadcast(view, 0))
                sent += 1
        t1 = time.perf_counter()
        while in_flight:
            in_flight.popleft().wait()
        stats["wire_wait_s"] += time.perf_counter() - t1
        reports = self._engine_calls(calls, "engines loading the buckets")
        return {
            "bytes": sum(b.nbytes for b in buckets) if rank == 0 else 0,
            "sent_bytes": sum(buckets[i].nbytes for i in mine),
            "buckets": len(buckets),
            "engine_s": max((r["seconds"] for r in reports), default=0.0),
            "engine_wire_wait_s": max((r.get("wire_wait_s", 0.0) for r in reports), default=0.0),
            **stats,
        }


# ---------------------------------------------------------------------- engine side (every vLLM worker)
@dataclass
class ReceiveBuckets(EngineStep):
    """One call per update: stream every bucket (bucket i broadcast on group routes[i][0] by its rank
    routes[i][1]) into the sink, and publish `version`.

    Up to `receive_ahead` later buckets are already being received while vLLM loads the current
    one, so the wire and the engine's load overlap (one per sender keeps every sender of a
    multi-sender update busy). `load=False` (benchmark profiling only, scripts/bench/bench_sync.py)
    receives and unpacks every bucket but skips vLLM's reload, to separate transport from load
    cost: the weights stay as they were.
    """

    finishes_requests: ClassVar[bool] = True

    buckets: list[Bucket]
    routes: list[tuple[str, int]]
    version: int
    receive_ahead: int
    load: bool

    def on_worker(self, receiver: WorkerReceiver) -> dict:
        buckets, routes = self.buckets, self.routes
        device = receiver.group(routes[0][0]).device if routes else torch.device("cpu")
        pool = receiver.pool(bucket_capacity(buckets), device)
        stats = {"bytes": 0, "wait_s": 0.0}

        def arrivals() -> Iterator[tuple[Bucket, torch.Tensor]]:
            posted: deque[tuple[torch.Tensor, object]] = deque()
            next_to_post = 0
            for k in range(len(buckets)):
                while next_to_post < len(buckets) and next_to_post <= k + self.receive_ahead:
                    buf = pool.acquire()[: buckets[next_to_post].nbytes]
                    group, src = routes[next_to_post]
                    posted.append((buf, receiver.group(group).broadcast(buf, src)))
                    next_to_post += 1
                buf, work = posted.popleft()
                t0 = time.perf_counter()
                work.wait()
                stats["wait_s"] += time.perf_counter() - t0
                stats["bytes"] += buckets[k].nbytes
                yield buckets[k], buf

        t0 = time.perf_counter()
        try:
            tensors = pool.stream(arrivals(), buffer_release_points(buckets))
            if not self.load:
                for _ in tensors:
                    pass
                return dict(stats, seconds=time.perf_counter() - t0)
            receiver.sink.reload(tensors)
        finally:
            receiver.release_buffers()
        return dict(stats, seconds=time.perf_counter() - t0)

    def publishes(self) -> int | None:
        return self.version

    def loaded(self) -> bool:
        return self.load

    def nbytes(self, per_worker: list[Any]) -> int:
        return sum(w["bytes"] for w in per_worker)

    def result(self, per_worker: list[Any], report: dict[str, Any] | None) -> dict[str, Any]:
        # Time this engine sat waiting for the wire (the rest of `seconds` is vLLM's load).
        return dict(report, wire_wait_s=max(w["wait_s"] for w in per_worker))
