"""How many CUDA GPUs this process can use, asked so that a CPU machine never imports torch for it.

Every configuration check needs the answer (NCCL, CUDA IPC and GPU placements are refused without
GPUs) and `import torch` alone costs ~1.5 s, most of a config error's time to come back. NVML (the
driver's management library; Ray bundles its Python binding) says in ~0.05 s whether the node has
NVIDIA GPUs at all; only when it has some is torch asked, so a GPU machine gets torch's answer
(a CPU build of torch, CUDA_VISIBLE_DEVICES) exactly as before.
"""

from __future__ import annotations


def nvidia_gpus_on_node() -> int:
    """NVIDIA GPUs NVML sees on this node (0 without a driver)."""
    from ray._private.accelerators import NvidiaGPUAcceleratorManager

    try:
        return int(NvidiaGPUAcceleratorManager.get_current_node_num_accelerators())
    except Exception:  # an NVML that fails to answer: let torch decide
        return -1


def cuda_device_count() -> int:
    """CUDA devices torch can use in this process; 0 without importing torch where NVML sees none."""
    if nvidia_gpus_on_node() == 0:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_available() -> bool:
    return cuda_device_count() > 0
