"""The strategies' receive halves without vLLM or Ray: a worker's steps against a recording sink
(the bytes a strategy's sender packed arrive as the same tensors, in order, and every pooled buffer
is free again once the update is over)."""

from __future__ import annotations

import torch

from rlhf_orch.sync.bucketed import ReceiveBuckets
from rlhf_orch.sync.buckets import TensorMeta, pack_bucket, plan_buckets
from rlhf_orch.sync.handover import LoadBucket, OpenHandover
from rlhf_orch.sync.object_store import HostBytesPayload
from rlhf_orch.sync.receive import CloseSession, WorkerReceiver


class RecordingSink:
    def __init__(self):
        self.calls: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def reload(self, tensors):
        self.calls.append("reload")
        self.tensors.update((name, t.clone()) for name, t in tensors)

    def begin(self):
        self.calls.append("begin")

    def load(self, tensors):
        self.calls.append("load")
        self.tensors.update((name, t.clone()) for name, t in tensors)

    def finish(self):
        self.calls.append("finish")


class _Done:
    def wait(self):
        pass


class PrepackedGroup:
    """A broadcast group whose broadcasts deliver the sender's packed buckets in order."""

    device = torch.device("cpu")

    def __init__(self, packed: list[torch.Tensor]):
        self.packed = list(packed)

    def broadcast(self, buf: torch.Tensor, src: int):
        buf.copy_(self.packed.pop(0))
        return _Done()


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.{p}": torch.randn(8, 4, generator=gen) for i in range(3) for p in ("a", "b")}


def _packed(weights, bucket_bytes):
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], bucket_bytes)
    packed = [pack_bucket(b, weights, torch.empty(b.nbytes, dtype=torch.uint8)).clone() for b in buckets]
    return buckets, packed


def test_bucketed_receive_streams_every_bucket_into_one_reload():
    weights = _weights()
    buckets, packed = _packed(weights, 300)
    receiver = WorkerReceiver(rank=0, sink=RecordingSink())
    receiver.groups["g"] = PrepackedGroup(packed)
    step = ReceiveBuckets(buckets, [("g", 0)] * len(buckets), version=4, receive_ahead=1, load=True)
    stats = step.on_worker(receiver)
    assert receiver.sink.calls == ["reload"]
    assert all(torch.equal(receiver.sink.tensors[n], t) for n, t in weights.items())
    assert stats["bytes"] == sum(b.nbytes for b in buckets) and step.publishes() == 4
    assert receiver._pool is None  # every buffer given back (host memory: until the next update)


def test_handed_over_buckets_load_inside_one_session():
    weights = _weights()
    buckets, packed = _packed(weights, 300)
    receiver = WorkerReceiver(rank=0, sink=RecordingSink())
    OpenHandover(buckets).on_worker(receiver)
    capacity = max(b.nbytes for b in buckets)
    loaded = [LoadBucket(b, HostBytesPayload(p), capacity).on_worker(receiver) for b, p in zip(buckets, packed)]
    CloseSession(5).on_worker(receiver)
    assert loaded == [b.nbytes for b in buckets]
    assert receiver.sink.calls == ["begin"] + ["load"] * len(buckets) + ["finish"]
    assert all(torch.equal(receiver.sink.tensors[n], t) for n, t in weights.items())
    assert receiver.session is None and receiver._pool is None
