"""What a trainer rank has got done, counted so the driver can tell a slow phase from a hung one.

A rank's experience or update phase can run longer than fault.step_timeout_s and be healthy (long
contexts, a large model); a rank stuck in a collective whose peer is gone is not. The rank counts
(a `WorkCount`): every micro-batch of its forward-only and training loops (`each`), the start
and end of every decoder layer's (and its attention's and MLP's) forward and -- when gradients
flow -- backward (`count_layers`), every tensor an update's forward saves for the backward, as it
is saved and as the backward uses it (`counting_saved_tensors`: one long micro-batch moves
operation by operation), and the entry to and exit from every collective it makes (`collective`:
DeepSpeed's backward and optimizer step, its all-reduces and gathers, the weight sync's sends, the
checkpoint's writes). The count is answered by the actor's `progress` on a thread of its own
(rlhf_orch.liveness); a count that stands over a window means a hung rank, one
that moves a busy one. A collective that never returns leaves the count at its entry.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_orch.liveness import WorkCount


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules of the classes Hugging Face names as never split
    (`_no_split_modules`: LlamaDecoderLayer, Qwen2DecoderLayer, ...); none for a model that names none."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    return [m for m in model.modules() if type(m).__name__ in names]


def counting_saved_tensors(progress: WorkCount) -> torch.autograd.graph.saved_tensors_hooks:
    """Within it, every tensor autograd saves for the backward counts in `progress` as it is saved
    and again as the backward uses it: the backward of one layer's attention over a long micro-batch
    moves the count operation by operation. The tensors are saved as they are (the hooks return them)."""

    def saved(tensor: torch.Tensor) -> torch.Tensor:
        progress.tick()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(saved, saved)


def counted_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What `count_layers` hooks: each decoder layer and its direct parts (attention, MLP, norms)."""
    return [module for layer in decoder_layers(model) for module in (layer, *layer.children())]


def count_layers(model: torch.nn.Module, progress: WorkCount) -> torch.nn.Module:
    """`model` with each decoder layer and its direct parts counted in `progress` as their forward
    starts and ends, and -- when gradients flow -- as their backward starts and ends (the gradients
    of their output and input arrive): one long micro-batch moves the count part by part, forward
    and backward. Returns `model`."""

    def tick_with_gradient(hidden: Any) -> None:
        progress.tick()
        hidden = hidden[0] if isinstance(hidden, tuple) and hidden else hidden
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(progress.tick)  # returns None: the gradient is left as it is

    for module in counted_modules(model):
        module.register_forward_pre_hook(
            lambda m, args, kwargs: tick_with_gradient(args or kwargs.get("hidden_states")), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, output: tick_with_gradient(output))
    return model
