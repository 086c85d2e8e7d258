"""CUDA IPC: trainer and engine colocated on the same GPU; no copy over any link.

Each engine worker is fed by the policy rank on its own GPU (`rlhf_orch.topology.plan.ipc_feeds`,
given by `use_plan`): that rank packs a bucket into one of its two persistent CUDA buffers
(under ZeRO-3 after gathering it on its own GPU) and hands the worker the buffer's IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`) together with its GPU's UUID. The worker opens
the handle on the visible GPU with that UUID -- which must be its own: a handle of another GPU is
refused, never re-pointed -- copies the bucket into its pooled buffer (a device-local copy), and
loads it exactly as the object-store strategy does. GPU only; validation requires CUDA,
`placement=colocated` and a policy rank on every engine GPU. Everything but `publish` and the
payload is the CPU-tested handover code (feeds included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_orch.sync.handover import HandoverSync

# Position of the device index in `rebuild_cuda_tensor`'s arguments (see torch.multiprocessing.reductions).
_DEVICE_ARG = 6


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_of(uuid: str, visible_uuids: list[str]) -> int:
    """This process's index of the GPU with `uuid`; refuses a GPU this process does not run on."""
    if uuid not in visible_uuids:
        raise RuntimeError(
            f"a CUDA IPC handle of GPU {uuid} reached a process that cannot see that GPU (it sees "
            f"{visible_uuids}): the engine worker is not fed by the policy rank on its own GPU"
        )
    return visible_uuids.index(uuid)


@dataclass
class CudaIpcPayload:
    rebuild: Any  # torch's rebuild_cuda_tensor
    args: tuple
    gpu: str  # UUID of the sender's GPU

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def open(self) -> torch.Tensor:
        args = list(self.args)
        # Indices differ between processes (CUDA_VISIBLE_DEVICES); the UUID does not.
        index = local_index_of(self.gpu, [gpu_uuid(i) for i in range(torch.cuda.device_count())])
        if index != torch.cuda.current_device():
            raise RuntimeError(
                f"CUDA IPC handle of GPU {self.gpu} sent to a worker running on GPU "
                f"{gpu_uuid(torch.cuda.current_device())}: feeds must pair each worker with the rank on its GPU"
            )
        args[_DEVICE_ARG] = index
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
    return CudaIpcPayload(rebuild, tuple(args), gpu_uuid(packed.device.index))


class CudaIpcSync(HandoverSync):
    transport = "cuda_ipc"

    def __init__(self, backend: str = "cuda_ipc", timeout_s: float = 120.0, bucket_mb: float = 512.0):
        super().__init__(backend, timeout_s, bucket_mb)

    def use_plan(self, plan) -> None:
        from rlhf_orch.topology.plan import feed_table, ipc_feeds

        self.feeds = feed_table(ipc_feeds(plan))

    def buffer_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def publish(self, packed: torch.Tensor) -> Any:
        return cuda_ipc_payload(packed)
