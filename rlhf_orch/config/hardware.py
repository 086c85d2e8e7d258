"""What this machine (or the Ray cluster) offers, as far as the config checks need to know."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What this machine (or the Ray cluster) offers, as far as checks need to know."""

    gpus: int  # GPUs Ray will offer (real, or logical when launcher.logical_gpus is set)
    cuda: bool  # real CUDA devices where the roles run (the launcher says: NCCL and CUDA IPC need them)
