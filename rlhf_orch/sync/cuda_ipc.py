"""CUDA IPC: trainer and engine colocated on the same GPU; no copy over any link.

The sender packs a bucket into one of its two persistent CUDA buffers and hands the engine the
buffer's IPC handle (`torch.multiprocessing.reductions.reduce_tensor`); the engine maps it and
copies the bucket into its own pooled buffer (a device-local copy), then loads it exactly as the
object-store strategy does. GPU only; validation requires CUDA and `placement=colocated`.
Everything but `publish` and the payload is the CPU-tested handover code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_orch.sync.handover import HandoverSync

# Position of the device index in `rebuild_cuda_tensor`'s arguments (see torch.multiprocessing.reductions).
_DEVICE_ARG = 6


@dataclass
class CudaIpcPayload:
    rebuild: Any  # torch's rebuild_cuda_tensor
    args: tuple

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def open(self) -> torch.Tensor:
        args = list(self.args)
        # Sender and engine may see the shared GPU under different indices (CUDA_VISIBLE_DEVICES).
        args[_DEVICE_ARG] = torch.cuda.current_device()
        return self.rebuild(*args)

    def copy_into(self, buffer: torch.Tensor) -> None:
        buffer.copy_(self.open())
        # The sender reuses its buffer once this call returns: the copy must have happened.
        torch.cuda.current_stream().synchronize()


def cuda_ipc_payload(packed: torch.Tensor) -> CudaIpcPayload:
    from torch.multiprocessing.reductions import reduce_tensor

    # The packing copies were queued on the current stream; the engine reads on another process.
    torch.cuda.current_stream().synchronize()
    rebuild, args = reduce_tensor(packed)
    return CudaIpcPayload(rebuild, tuple(args))


class CudaIpcSync(HandoverSync):
    transport = "cuda_ipc"

    def __init__(self, backend: str = "cuda_ipc", timeout_s: float = 120.0, bucket_mb: float = 512.0):
        super().__init__(backend, timeout_s, bucket_mb)

    def buffer_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def publish(self, packed: torch.Tensor) -> Any:
        return cuda_ipc_payload(packed)
