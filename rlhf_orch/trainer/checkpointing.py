"""A trained role's state on disk: DeepSpeed's checkpoint plus each rank's RNG state (resume), and
the policy in Hugging Face format (export)."""

from __future__ import annotations

import os

import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.rng import rng_state, set_rng_state
from rlhf_orch.trainer.lora import ADAPTER_DIR, export_adapter
from rlhf_orch.trainer.policy_weights import PolicyWeights


def save_checkpoint(engine, directory: str, rank: int, adapters_only: bool, work_done: WorkCount) -> None:
    """DeepSpeed's checkpoint of a role (every rank calls: ZeRO partitions are per rank) and this
    rank's RNG state (DeepSpeed keeps `client_state` from rank 0 only). `adapters_only` (model.lora):
    only the adapters and their optimizer states -- the frozen base is the model's own checkpoint,
    loaded again by `build`."""
    with work_done.collective():
        engine.save_checkpoint(directory, tag="state", save_latest=False, exclude_frozen_parameters=adapters_only)
    torch.save(rng_state(), os.path.join(directory, f"rng_rank{rank}.pt"))


def load_checkpoint(engine, directory: str, rank: int, role: str, adapters_only: bool, work_done: WorkCount) -> None:
    """What `save_checkpoint` wrote, back into `engine` and this rank's RNG."""
    with work_done.collective():
        path, _ = engine.load_checkpoint(
            directory,
            tag="state",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            # (the adapters' checkpoint has no base weights; a checkpoint of another model.lora is
            # refused before any actor starts: `model` keys are breaking, orchestration/checkpoint.py)
            load_module_strict=not adapters_only,
        )
    if path is None:
        raise RuntimeError(f"no DeepSpeed checkpoint of the {role} in {directory}")
    set_rng_state(torch.load(os.path.join(directory, f"rng_rank{rank}.pt"), weights_only=True))


@torch.no_grad()
def export_hf(engine, weights: PolicyWeights, directory: str, rank: int, model_path: str, work_done: WorkCount) -> None:
    """The policy in Hugging Face format (safetensors + config + tokenizer), loadable as is by
    vLLM and transformers; under model.lora the adapter too, as PEFT saves one. Every rank calls
    (ZeRO-3 gathers are collective); rank 0 writes."""
    names = [m.name for m in weights.full.metas()]
    with work_done.collective(), weights.full.gathered(names) as full:
        if rank == 0:
            state = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in full.items()}
            base = engine.module if weights.lora is None else engine.module.get_base_model()
            base.save_pretrained(directory, state_dict=state, safe_serialization=True)
    if weights.lora is not None:
        export_adapter(weights.adapter, engine.module, os.path.join(directory, ADAPTER_DIR), rank == 0)
    if rank == 0:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_path).save_pretrained(directory)
