"""An engine serving the base with the policy's LoRA adapter (`model.lora.sync=adapter`).

vLLM serves adapters per request (`LoRARequest`) and loads them from a directory; here the adapter
arrives over the weight sync as tensors, so the worker builds vLLM's `LoRAModel` from them in
memory (`LoRAModel.from_lora_tensors`) and swaps it into its LoRA manager under one fixed id, in
place at every update -- no file is written or read (veRL hands vLLM its adapters the same way).
Every request then names that id: `AdapterServingLLM` adds it to every generate/enqueue call, so no
rollout, turn, agent call or scoring pass can reach the bare base by mistake.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping, Sequence

import torch

from rlhf_orch.models.lora import LoraSettings

#: The adapter's name and id in every engine: one adapter, replaced in place at each update.
ADAPTER_NAME = "policy"
ADAPTER_ID = 1
#: Never read: the adapter is resident before any request names it (vLLM's request type needs a path).
IN_MEMORY_PATH = "/in-memory/rlhf_orch/policy-adapter"


class AdapterNotServable(ValueError):
    """model.lora.sync=adapter on a model vLLM cannot serve with a LoRA adapter."""


def serves_adapter(settings: LoraSettings, model_path: str) -> bool:
    """(Engine process, before `vllm.LLM` starts.) Whether this engine takes the policy's adapter:
    `model.lora.sync` resolved -- `auto` is `adapter` where vLLM's model class for the checkpoint's
    architecture supports LoRA (and this vLLM has what serving from memory uses), else `merged`."""
    if settings.sync == "merged":
        return False
    arch = _architecture(model_path)
    why_not = _why_not_served(arch)
    if why_not is None:
        return True
    if settings.sync == "adapter":
        raise AdapterNotServable(f"model.lora.sync=adapter: {why_not}; set model.lora.sync=merged (or auto)")
    return False


def _why_not_served(arch: str) -> str | None:
    """Why this engine cannot serve the adapter (None: it can): vLLM's model class for `arch` takes
    no LoRA, or this vLLM lacks what serving from memory uses beyond its public API (checked here,
    at start, instead of failing at the first update; `SUPPORTED_VLLM` is the range it was written
    against)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.model_executor.models import ModelRegistry, supports_lora

    missing = [
        name
        for owner, name in (
            (LoRAModel, "from_lora_tensors"),
            (LoRAModelManager, "create_dummy_lora"),
            (LoRAModelManager, "add_adapter"),
            (LoRAModelManager, "activate_adapter"),
            (ModelRegistry, "_try_load_model_cls"),
        )
        if not hasattr(owner, name)
    ]
    if missing:
        return f"this vLLM lacks {missing}, which serving an adapter from memory uses"
    # (vLLM's registry has no public per-architecture LoRA query; this imports that one model module.)
    model_cls = ModelRegistry._try_load_model_cls(arch)
    if model_cls is None or not supports_lora(model_cls):
        return f"vLLM's {arch} takes no LoRA adapter"
    return None


def _architecture(model_path: str) -> str:
    import json
    import os

    from rlhf_orch.models.hub import resolve_local_checkpoint

    with open(os.path.join(resolve_local_checkpoint(model_path, "model"), "config.json")) as f:
        return (json.load(f).get("architectures") or ["?"])[0]


def vllm_lora_args(settings: LoraSettings, model_path: str) -> dict[str, Any]:
    """`vllm.LLM(...)` arguments for an engine serving one adapter of `settings.rank` on the layers
    it targets. Naming them keeps vLLM from wrapping the rest -- the output head above all, which
    no adapter here has: its LoRA logits path costs a [tokens, vocab] product per step, and on the
    CPU it breaks prompt log-probs (it expects one row per request)."""
    return {
        "enable_lora": True,
        "max_lora_rank": settings.engine_max_rank(),
        "max_loras": 1,
        "lora_target_modules": adapter_target_names(settings, model_path),
    }


def adapter_target_names(settings: LoraSettings, model_path: str) -> list[str]:
    """The adapted layers' names (suffixes, as PEFT and vLLM match them). "all-linear" is resolved
    as PEFT resolves it: every linear layer of the model but the output head (read off the model's
    structure on the meta device: no weights are loaded)."""
    targets = settings.targets()
    if not isinstance(targets, str):
        return sorted(set(targets))
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_orch.models.hub import resolve_local_checkpoint

    config = AutoConfig.from_pretrained(resolve_local_checkpoint(model_path, "model"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
        }
    )


def peft_helper_dict(settings: LoraSettings) -> dict[str, Any]:
    """What vLLM's `PEFTHelper` needs of the adapter: the fields of the PEFT config it was trained with."""
    peft = settings.peft_kwargs()
    return {key: peft[key] for key in ("r", "lora_alpha", "target_modules")}


class AdapterServingLLM:
    """A `vllm.LLM` whose generate / enqueue calls all name the served adapter. From the start: the
    worker registers a zero adapter (B = 0: the base exactly, as the trainer's adapters start) before
    any request, so a request in flight when an update lands switches to the new adapter with the
    rest, as under full weights -- none stays on the bare base."""

    def __init__(self, llm: Any):
        from vllm.lora.request import LoRARequest

        self._llm = llm
        self.adapter_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, IN_MEMORY_PATH)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("lora_request", self.adapter_request)
        return self._llm.generate(*args, **kwargs)

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("lora_request", self.adapter_request)
        return self._llm.enqueue(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # everything else is the LLM's own
        return getattr(self._llm, name)


class AdapterUpdate:
    """(vLLM worker.) One update's adapter tensors, collected as they arrive, then swapped in."""

    def __init__(self, peft_helper: dict[str, Any]):
        self.peft_helper = peft_helper
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Copies: the receive buffers are reused for the next bucket.
        for name, tensor in items:
            self.tensors[name] = tensor.clone()

    def apply(self, lora_manager: Any) -> int:
        """Replace the served adapter with these tensors (vLLM's manager copies them into its
        per-layer LoRA buffers when it activates the adapter). Returns the number of layers."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        if not self.tensors:
            raise RuntimeError("an adapter update carried no tensor")
        manager = lora_manager._adapter_manager
        helper = PEFTHelper.from_dict(
            dict(self.peft_helper, vllm_max_position_embeddings=lora_manager.max_position_embeddings)
        )
        helper.validate_legal(lora_manager.lora_config)
        # The names mapped and skipped as vLLM's own loader does (`WorkerLoRAManager._load_adapter`).
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            self.tensors,
            helper,
            device="cpu",
            dtype=lora_manager.lora_config.lora_dtype,
            model_vocab_size=lora_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )
        # Checked before the served adapter is touched: a refused update leaves it serving.
        missing, unknown = layer_coverage(
            manager.modules, manager.packed_modules, lora_manager.lora_config.target_modules, adapter.loras
        )
        if missing:  # vLLM would serve the bare base for them (activate_adapter resets a layer it finds no weights for)
            raise RuntimeError(
                f"the adapter update lacks layers the engine serves the adapter on (model.lora.target_modules): {len(missing)} "
                f"of them, e.g. {missing[:4]}; every update must carry every adapted layer (they would serve the base)"
            )
        if unknown:  # the trainer adapts a layer the engine does not: it would serve the base there
            raise RuntimeError(
                f"the adapter update names layers the engine does not adapt: {len(unknown)} of them, e.g. {unknown[:3]}"
            )
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(adapter)  # fuses q/k/v and gate/up adapters as vLLM fuses those layers
        manager.activate_adapter(ADAPTER_ID)
        return len(adapter.loras)


def layer_coverage(
    wrapped: Iterable[str],
    packed: Mapping[str, Sequence[str]],
    targets: Collection[str] | None,
    adapter_layers: Iterable[str],
) -> tuple[list[str], list[str]]:
    """(the layers the engine adapts that an update lacks, the update's layers the engine does not
    adapt), by module name. `wrapped`: the modules vLLM's LoRA manager wraps; `packed`: those that fuse
    several layers (qkv_proj: q, k and v_proj), each needing its parts the engine targets (`targets`:
    layer-name suffixes, None for all)."""
    expected: set[str] = set()
    known: set[str] = set()
    for module in wrapped:
        parts = list(packed.get(module) or [module])
        known.update(parts)
        expected.update(p for p in parts if targets is None or p in targets or p.rsplit(".", 1)[-1] in targets)
    have = set(adapter_layers)
    return sorted(expected - have), sorted(have - known)


def serve_zero_adapter(lora_manager: Any, rank: int) -> None:
    """(vLLM worker.) Register and activate the served adapter with every A and B zero: what the
    trainer's adapters compute before their first update (B = 0), the base exactly."""
    manager = lora_manager._adapter_manager
    manager.remove_adapter(ADAPTER_ID)
    manager.add_adapter(manager.create_dummy_lora(ADAPTER_ID, rank, lora_manager.embedding_modules))  # zeros
    manager.activate_adapter(ADAPTER_ID)
