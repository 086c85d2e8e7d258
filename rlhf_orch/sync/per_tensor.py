"""Per-tensor broadcast: the baseline as OpenRLHF does it.

For every parameter: gather it (ZeRO-3), tell every engine what is coming (one RPC each),
broadcast that one tensor, wait for every engine to load it. Hundreds of round trips per update.
Both halves: the sender (`PerTensorBroadcastSync.send`) and the engine's receive (`ReceiveTensor`,
in every vLLM worker, inside the layer-wise session `OpenSession` ... `CloseSession` opens and closes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_orch.sync.base import WeightSync
from rlhf_orch.sync.buckets import TensorMeta, dtype_from_name
from rlhf_orch.sync.group import DEFAULT_GROUP, BroadcastGroup
from rlhf_orch.sync.receive import CloseSession, EngineStep, OpenSession, WorkerReceiver


class PerTensorBroadcastSync(WeightSync):
    def send(
        self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int
    ) -> dict[str, Any]:
        sent = 0
        is_sender = rank == 0
        if is_sender:
            self._engine_calls(
                [e.receive_weights.remote(OpenSession()) for e in engines], "opening the engines' reload session"
            )
        for meta in weights.metas():
            with weights.gathered([meta.name]) as tensors:  # collective under ZeRO-3: all ranks
                if not is_sender:
                    continue
                calls = [e.receive_weights.remote(ReceiveTensor(meta, 0)) for e in engines]
                group.broadcast(tensors[meta.name].contiguous(), 0).wait()
                self._engine_calls(calls, f"loading {meta.name}")
                sent += meta.nbytes
        if is_sender:
            self._engine_calls(
                [e.receive_weights.remote(CloseSession(version)) for e in engines], "closing the reload session"
            )
        return {"bytes": sent, "calls": len(weights.metas()) * len(engines) if is_sender else 0}


# ---------------------------------------------------------------------- engine side (every vLLM worker)
@dataclass
class ReceiveTensor(EngineStep):
    """One parameter, broadcast by group rank `src`, into the open session."""

    meta: TensorMeta
    src: int
    group: str = DEFAULT_GROUP

    def on_worker(self, receiver: WorkerReceiver) -> int:
        group = receiver.group(self.group)
        tensor = torch.empty(self.meta.shape, dtype=dtype_from_name(self.meta.dtype), device=group.device)
        group.broadcast(tensor, self.src).wait()
        receiver.sink.load([(self.meta.name, tensor)])
        return self.meta.nbytes

    def result(self, per_worker: list[Any], report: dict[str, Any] | None) -> int:
        return sum(per_worker)
