"""The `engine` section's declarations: vLLM engine settings (`rlhf_orch.engines.vllm_engine`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    """vLLM engine settings."""

    # KV cache of one engine (per GPU of it, per worker of a CPU engine), GiB: vLLM's
    # kv_cache_memory_bytes, which replaces gpu_memory_utilization (leave that null). null: on GPUs
    # vLLM sizes the cache from gpu_memory_utilization; on CPU it holds every sequence of the training
    # rollouts the engine generates at once at full length, with headroom; a held-out evaluation of
    # more runs in waves (rlhf_orch.engines.launch.cpu_kv_cache_bytes).
    kv_cache_gb: Optional[float] = None
    # Fraction of each engine GPU's memory vLLM may take; null = the engine's planned GPU share
    # (placement.engine_fraction when colocated, 0.9 on GPUs of its own). Validated against the plan.
    gpu_memory_utilization: Optional[float] = None
    # vLLM sleep level between a rollout and the next weight sync (frees GPU memory for training):
    # 0 off, 1 weights to CPU + KV cache dropped, 2 weights and KV cache dropped (re-sent by the sync);
    # null = 1 for colocated GPU layouts, 0 otherwise (docs/gpu.md).
    sleep_level: Optional[int] = None
    enable_prefix_caching: bool = True
    # Tokens per KV-cache block; prefix caching shares whole blocks only. null = 32 on CPU engines
    # (vLLM's CPU default, 128, is longer than most prompts: a GRPO group's samples then recompute
    # their shared prompt -- measured on SmolLM2 with 102-token prompts, 4 x 8 samples of 16
    # tokens: 3.84 s a rollout at 128, 1.51 s at 32; docs/benchmarks.md), vLLM's default on GPUs.
    block_size: Optional[int] = None
    enforce_eager: bool = True
    # Threads of each engine process's CPU work (OMP_NUM_THREADS, which vLLM's CPU backend binds at
    # start). Ray gives a one-CPU actor one thread; under pipeline=sync the trainers wait while the
    # engine generates, so the engine may use their cores too (SmolLM2, 32 x 64 tokens on this
    # 2-core machine: 28.8 s on one thread, 15.3 s on two; docs/benchmarks.md). Overlapping
    # pipelines (one_step_off, async) run engine and trainers at once: more threads than cores slow both.
    torch_threads: int = 1
