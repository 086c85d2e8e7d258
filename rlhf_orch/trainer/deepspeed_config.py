"""The DeepSpeed config dict for one trainer role: a pure function of our config."""

from __future__ import annotations

from typing import Any


def zero_stage_to_run(configured: int, data_parallel_size: int, offload_optimizer: bool) -> int:
    """The ZeRO stage a trained role's DeepSpeed engine runs: trainer.zero_stage, except stage 0 for
    ZeRO-1 and ZeRO-2 on a role of one rank without optimizer offload (which needs ZeRO). With one
    rank there is nothing to partition, and ZeRO-1/2 only add a flat fp32 copy of the weights and
    gradient buckets beside the model's own (1.1 GB on SmolLM2 in float32); stage 0 is DeepSpeed's
    plain optimizer path, the same update in float32 (tests/algo/test_oracle_matrix.py runs its
    one-rank cases so; scripts/bench/bench_one_rank_zero.py compares the weights). In bfloat16 or
    float16 stage 0 steps through DeepSpeed's 16-bit optimizer wrappers instead: not run on this
    project's CPU machine, to be checked on a GPU. ZeRO-3 is kept as set: it is what the
    sharded-parameter paths (the sync's gathers, a reference sharded in the policy's process) run
    with, and what a one-rank test of them asks for."""
    if data_parallel_size == 1 and configured in (1, 2) and not offload_optimizer:
        return 0
    return configured


def deepspeed_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    train_batch_size: int,
    data_parallel_size: int,
    grad_clip: float,
    dtype: str,
    offload_optimizer: bool = False,
) -> dict[str, Any]:
    grad_accum = train_batch_size // (micro_batch_size * data_parallel_size)
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * grad_accum * data_parallel_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # ZeRO wraps any torch optimizer; DeepSpeed asks for this flag for those it did not test
        # (trainer.optimizer=sgd).
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif dtype == "float16":
        config["fp16"] = {"enabled": True}
    if offload_optimizer:
        # ZeRO-Offload: optimizer states, fp32 master weights and gradients in pinned host memory,
        # the optimizer step on the CPU (trainer.offload_optimizer; GPU layouts only).
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if zero_stage == 3:
        # Gather-on-demand is what makes ZeRO-3 useful; keep prefetch modest for small models.
        config["zero_optimization"].update(
            {"stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e4}
        )
    return config


def frozen_model_config(*, dtype: str, data_parallel_size: int, offload_params: bool) -> dict[str, Any]:
    """DeepSpeed's config for a forward-only model sharded by ZeRO-3 (trainer.reference_memory):
    each rank keeps 1/data_parallel_size of the weights and gathers a layer's parameters for its
    forward; `offload_params` keeps the shards in pinned host memory (GPU layouts only). No
    optimizer: the batch keys only satisfy DeepSpeed's checks."""
    # memory_efficient_linear off: it replaces torch's linear for the whole process (a hosted
    # reference would change the policy's own training kernels).
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_prefetch_bucket_size": 5e7,
        "memory_efficient_linear": False,
    }
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": data_parallel_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif dtype == "float16":
        config["fp16"] = {"enabled": True}
    return config
