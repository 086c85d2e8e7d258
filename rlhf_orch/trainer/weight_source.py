"""The trainer's weights as a sync strategy sees them: metadata, then full tensors on demand.

Under ZeRO-3 each rank holds a shard of every parameter; `gathered(names)` all-gathers exactly the
parameters of one bucket (or one tensor for per-tensor sync), so a sync never materialises the
whole model at once and never gathers one tensor at a time when it sends buckets.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from rlhf_orch.liveness import WorkCount
from rlhf_orch.sync.buckets import TensorMeta, dtype_name


class ModuleWeightSource:
    """Parameters of an HF model wrapped by DeepSpeed, under their checkpoint names."""

    def __init__(self, module: nn.Module, zero_stage: int):
        self.module = module
        self.zero_stage = zero_stage
        # named_parameters() drops duplicates, so tied lm_head is sent once as embed_tokens.
        self._params: dict[str, nn.Parameter] = dict(module.named_parameters())

    def metas(self) -> list[TensorMeta]:
        metas = []
        for name, p in self._params.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape here
            metas.append(TensorMeta(name, dtype_name(p.dtype), shape))
        return metas

    @contextlib.contextmanager
    def gathered(self, names: list[str], modifier_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Full tensors of `names` for the duration of the block (collective under ZeRO-3).

        `modifier_rank`: under ZeRO-3, the rank whose in-place changes are kept (None: read only).
        """
        params = [self._params[n] for n in names]
        with gathered_parameters(params, self.zero_stage, modifier_rank):
            yield {n: p.data for n, p in zip(names, params)}


@contextlib.contextmanager
def gathered_parameters(
    params: list[nn.Parameter], zero_stage: int, modifier_rank: int | None = None
) -> Iterator[None]:
    """`params` whole for the duration of the block: all-gathered under ZeRO-3 (collective: every
    rank enters), as they are otherwise. `modifier_rank` as `ModuleWeightSource.gathered` takes it."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield
    else:
        yield


def on_cpu(source, rank: int, work_done: WorkCount) -> dict[str, torch.Tensor] | None:
    """Every tensor of a weight view (`metas()` / `gathered()`), copied to CPU on rank 0 (None on
    the others, which gather too: under ZeRO-3 the gather is collective)."""
    with work_done.collective(), source.gathered([m.name for m in source.metas()]) as tensors:
        return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()} if rank == 0 else None
