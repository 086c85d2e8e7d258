"""A trainer process gives its cached CUDA memory back when a phase of the step ends, where another
process on its GPU needs it next.

The memory plan counts a shared GPU by phase (rlhf_orch/memory/plan.py): a trainer's experience
logits only in the experience phase, its update's activations only in training, a sleeping
colocated engine's weights and KV cache only in generation. torch's caching allocator keeps what a
phase freed reserved in the process, so without giving it back a sleeping engine would wake into a
GPU the trainers still hold at their training peak (7B PPO colocated under pipeline=sync: ~94 GB of
an 80 GB GPU where the plan says 84.7). So at the end of its experience and update calls a trainer
that shares its GPU (`PlacementPlan.shares_gpu`: `TrainerSpec.free_cache_between_phases`) empties
the cache. What that costs on a GPU (the call, and the next phase allocating again) is not measured
yet: `scripts/bench/bench_gpu.py --parts memory` measures it (docs/memory.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def frees_cache_between_phases(shares_gpu: bool, device: torch.device) -> bool:
    """Whether a process gives its cached CUDA memory back as a phase ends: it runs on a CUDA device
    that another process of the run shares (CPU processes have no such cache)."""
    return shares_gpu and device.type == "cuda"


def release_cached_memory() -> None:
    """Every cached block no tensor uses back to the device (the GPU-only line)."""
    torch.cuda.empty_cache()


def ends_a_phase(method: F) -> F:
    """A trainer method that ends a phase of the step (experience, update, scoring): once it
    returned, its process gives its cached CUDA memory back where `frees_cache_between_phases`."""

    @functools.wraps(method)
    def ended(self, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if frees_cache_between_phases(self.spec.free_cache_between_phases, self.device):
            release_cached_memory()
        return result

    ended.ends_a_phase = True  # (which calls end a phase: tests/trainer/test_phase_memory.py)
    return ended  # type: ignore[return-value]
