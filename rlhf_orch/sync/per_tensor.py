"""Per-tensor broadcast: the baseline as OpenRLHF does it.

For every parameter: gather it (ZeRO-3), tell every engine what is coming (one RPC each),
broadcast that one tensor, wait for every engine to load it. Hundreds of round trips per update.
"""

from __future__ import annotations

from typing import Any

from rlhf_orch.sync.base import WeightSync
from rlhf_orch.sync.group import BroadcastGroup


class PerTensorBroadcastSync(WeightSync):
    def send(self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int) -> dict[str, Any]:
        sent = 0
        is_sender = rank == 0
        if is_sender:
            self._engine_calls([e.begin_update.remote() for e in engines], "opening the engines' reload session")
        for meta in weights.metas():
            with weights.gathered([meta.name]) as tensors:  # collective under ZeRO-3: all ranks
                if not is_sender:
                    continue
                calls = [e.receive_tensor.remote(meta, 0) for e in engines]
                group.broadcast(tensors[meta.name].contiguous(), 0).wait()
                self._engine_calls(calls, f"loading {meta.name}")
                sent += meta.nbytes
        if is_sender:
            self._engine_calls([e.finish_update.remote(version) for e in engines], "closing the reload session")
        return {"bytes": sent, "calls": len(weights.metas()) * len(engines) if is_sender else 0}
