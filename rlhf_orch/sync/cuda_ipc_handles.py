"""CUDA IPC handles of packed buckets: what the `cuda_ipc` sync hands from a trainer rank to the engine
worker on the same GPU (torch only: no Ray, no vLLM, so the GPU tests and `scripts/bench/bench_gpu.py`
use it on a machine that has neither).

The sender publishes a packed bucket's IPC handle (`torch.multiprocessing.reductions.reduce_tensor`)
with its GPU's UUID; the receiver opens it on the visible GPU with that UUID -- which must be its
own: a handle of another GPU is refused, never re-pointed -- and copies the bucket out before the
sender reuses its buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
