"""The policy with LoRA adapters (`model.lora`, the `peft` package), and its weights as a sync sees them.

`apply_lora` wraps the loaded policy in a PEFT model: the base is frozen, only the adapters train
(DeepSpeed's optimizer gets the trainable parameters only, so the base carries no optimizer state).
What leaves the trainer is one of two weight sources, both with `metas()` / `gathered(names)` like
`ModuleWeightSource`, so every sync strategy, the export and the checkpoints stay unchanged:

- `MergedLoraWeights`: the base's own checkpoint names, each adapted layer as W + alpha/r * B @ A
  (computed at gather time, the base is never modified): `model.lora.sync=merged`, the HF export,
  `full_weights`;
- `AdapterWeights`: the adapter tensors under PEFT's saved names (`base_model.model.<layer>.lora_A.weight`),
  what vLLM's LoRA loader parses: `model.lora.sync=adapter`.

The reference of a KL term is the frozen base itself (`frozen_base`: the adapters switched off for
one forward), so no second copy of the base is loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.sync.buckets import TensorMeta, dtype_name
from rlhf_orch.trainer.weight_source import ModuleWeightSource, gathered_parameters

_ADAPTER = "default"  # PEFT's name for the one adapter a model gets
_PEFT_PREFIX = "base_model.model."


def apply_lora(model: nn.Module, settings: LoraSettings, seed: int) -> nn.Module:
    """`model` (an HF causal LM) with trainable LoRA adapters on `settings.target_modules`, the rest
    frozen. B starts at zero (PEFT's init), so the wrapped model computes exactly what the base does;
    A's random init is drawn from `seed` alone, so every data-parallel rank (and the oracle) starts
    from the same adapters."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, LoraConfig(**settings.peft_kwargs()))
    not_linear = [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer) and _ADAPTER not in m.lora_A]
    if not_linear:  # an embedding's adapter: neither merged nor sent here (the config check refuses the names)
        raise ValueError(
            f"model.lora.target_modules={settings.target_modules!r} adapts non-linear layers {not_linear[:2]}: target linear layers"
        )
    return peft_model


@dataclass(frozen=True)
class AdaptedLayer:
    """One layer with an adapter: its base weight and the two adapter matrices, and the scale."""

    name: str  # the base weight's checkpoint name (model.layers.0.self_attn.q_proj.weight)
    weight: nn.Parameter
    lora_a: nn.Parameter  # [rank, in]
    lora_b: nn.Parameter  # [out, rank]
    scaling: float


def adapted_layers(peft_model: nn.Module) -> dict[str, AdaptedLayer]:
    """Every adapted layer of a PEFT model, by its base weight's checkpoint name."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for module_name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and _ADAPTER in module.lora_A:
            name = _checkpoint_name(f"{module_name}.weight")
            layers[name] = AdaptedLayer(
                name,
                module.get_base_layer().weight,
                module.lora_A[_ADAPTER].weight,
                module.lora_B[_ADAPTER].weight,
                float(module.scaling[_ADAPTER]),
            )
    return layers


def _checkpoint_name(peft_name: str) -> str:
    """A PEFT model's parameter name as the base checkpoint names it."""
    name = peft_name[len(_PEFT_PREFIX) :] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def _shape(p: nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape here


class MergedLoraWeights:
    """The policy as full weights under the base's names: adapted layers merged on the fly."""

    def __init__(self, module: nn.Module, zero_stage: int):
        self.module = module
        self.zero_stage = zero_stage
        self._layers = adapted_layers(module)
        # Every parameter that is neither an adapter nor an adapted base weight passes as it is
        # (named_parameters() drops duplicates: a tied head goes once, as embed_tokens).
        self._plain: dict[str, nn.Parameter] = {
            _checkpoint_name(n): p
            for n, p in module.named_parameters()
            if ".lora_" not in n and _checkpoint_name(n) not in self._layers
        }
        self._order = [_checkpoint_name(n) for n, _ in module.named_parameters() if ".lora_" not in n]
        # An adapted layer whose weight is shared with another (a head tied to the embedding) is
        # listed once, under the other's name: its adapter would silently be left out.
        hidden = sorted(set(self._layers) - set(self._order))
        if hidden:
            raise ValueError(f"adapted layers share their weight with another layer and cannot be merged: {hidden}")

    def metas(self) -> list[TensorMeta]:
        metas = []
        for name in self._order:
            p = self._layers[name].weight if name in self._layers else self._plain[name]
            metas.append(TensorMeta(name, dtype_name(p.dtype), _shape(p)))
        return metas

    @contextlib.contextmanager
    def gathered(self, names: list[str], modifier_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Full tensors of `names` (read only: merged layers are new tensors)."""
        if modifier_rank is not None:
            raise ValueError("the merged view of a LoRA policy is read only (change the adapters instead)")
        params: list[nn.Parameter] = []
        for n in names:
            if n in self._layers:
                layer = self._layers[n]
                params += [layer.weight, layer.lora_a, layer.lora_b]
            else:
                params.append(self._plain[n])
        with gathered_parameters(params, self.zero_stage):
            # Merged on access: a rank that only takes part in the gather (ZeRO-3) computes nothing.
            yield _MergedOnAccess({n: self._layers.get(n) for n in names}, self._plain)


class _MergedOnAccess(Mapping):
    """name -> tensor: a plain parameter's data, or an adapted layer merged when it is read."""

    def __init__(self, layers: dict[str, AdaptedLayer | None], plain: dict[str, nn.Parameter]):
        self._layers, self._plain = layers, plain

    def __getitem__(self, name: str) -> torch.Tensor:
        layer = self._layers[name]
        return merged(layer) if layer is not None else self._plain[name].data

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


@torch.no_grad()
def merged(layer: AdaptedLayer) -> torch.Tensor:
    """W + scaling * B @ A, in the base weight's dtype (the product in float32)."""
    delta = layer.lora_b.data.float() @ layer.lora_a.data.float()
    return (layer.weight.data.float() + layer.scaling * delta).to(layer.weight.dtype)


class AdapterWeights(ModuleWeightSource):
    """The adapter tensors only, under the names PEFT saves them with (and vLLM loads them by);
    `metas()` / `gathered()` as `ModuleWeightSource` gives them for the whole model."""

    def __init__(self, module: nn.Module, zero_stage: int):
        self.module = module
        self.zero_stage = zero_stage
        self._params: dict[str, nn.Parameter] = {}
        for layer in adapted_layers(module).values():
            stem = _PEFT_PREFIX + layer.name[: -len(".weight")]
            self._params[f"{stem}.lora_A.weight"] = layer.lora_a
            self._params[f"{stem}.lora_B.weight"] = layer.lora_b


@contextlib.contextmanager
def frozen_base(peft_model: nn.Module) -> Iterator[nn.Module]:
    """The base model without its adapters for the duration of the block (the KL reference)."""
    with peft_model.disable_adapter():
        yield peft_model


#: The adapter's directory inside an HF export (beside the merged model's files).
ADAPTER_DIR = "adapter"


def export_adapter(adapter: AdapterWeights, peft_model: nn.Module, directory: str, write: bool) -> None:
    """The adapter as PEFT saves one (adapter_config.json + adapter_model.safetensors), loadable by
    `PeftModel.from_pretrained` and by vLLM's `LoRARequest`. Every rank calls (ZeRO-3 gathers are
    collective); `write` on the one that writes."""
    import json
    import os

    from safetensors.torch import save_file

    names = [m.name for m in adapter.metas()]
    with adapter.gathered(names) as tensors:
        if not write:
            return
        state = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(state, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_model.peft_config[_ADAPTER].to_dict()  # target_modules as PEFT resolved them
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
