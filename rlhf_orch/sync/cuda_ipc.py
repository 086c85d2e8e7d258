"""CUDA IPC: trainer and engine colocated on the same GPU; no copy over any link.

Each engine worker is fed by the policy rank on its own GPU (`rlhf_orch.topology.plan.ipc_feeds`,
given by `use_plan`): that rank packs a bucket into one of its two persistent CUDA buffers
(under ZeRO-3 after gathering it on its own GPU) and hands the worker the buffer's IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`) together with its GPU's UUID. The worker opens
the handle on the visible GPU with that UUID -- which must be its own: a handle of another GPU is
refused, never re-pointed -- copies the bucket into its pooled buffer (a device-local copy), and
loads it exactly as the object-store strategy does. GPU only; validation requires CUDA,
`placement=colocated` and a policy rank on every engine GPU. Everything but `publish` and the
payload (`rlhf_orch.sync.cuda_ipc_handles`) is the CPU-tested handover code (feeds included).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_orch.sync.cuda_ipc_handles import cuda_ipc_payload
from rlhf_orch.sync.handover import HandoverSync


class CudaIpcSync(HandoverSync):
    transport = "cuda_ipc"
    shares_cuda_memory = True

    def use_plan(self, plan) -> None:
        from rlhf_orch.topology.plan import feed_table, ipc_feeds

        self.feeds = feed_table(ipc_feeds(plan))

    def buffer_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def publish(self, packed: torch.Tensor) -> Any:
        return cuda_ipc_payload(packed)
