"""Forward-only models of a trainer rank: the reference (the frozen initial policy, whole or
sharded by ZeRO-3 as trainer.reference_memory says), the teacher (another checkpoint, held the
same way) and the reward model, and their log-probs of a shard (collective when sharded)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.deepspeed_config import frozen_model_config
from rlhf_orch.trainer.deepspeed_startup import skip_muon_import
from rlhf_orch.trainer.forward import load_policy, sequence_logprobs
from rlhf_orch.trainer.progress import count_layers
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` forward-only: eval mode, no gradients."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_frozen(loader: Callable, spec: TrainerSpec, device: torch.device, work_done: WorkCount) -> torch.nn.Module:
    """A forward-only model (reward model) loaded whole on `device`, its layers counted in `work_done`."""
    return count_layers(frozen(loader(spec.model_path, spec.dtype, device).to(device)), work_done)


def reference_model(spec: TrainerSpec, device: torch.device, world_size: int, work_done: WorkCount) -> torch.nn.Module:
    """The frozen initial policy as `trainer.reference_memory` says to hold it: whole on this
    rank, or sharded by ZeRO-3 over this process's torch.distributed world (the reference
    ranks, or the policy ranks hosting it), its shards in host memory when offloaded. A sharded
    forward is collective: every rank of the world runs the same micro-batches' forwards (the
    transfers give each rank as many, empty stand-ins included)."""
    if spec.reference_memory == "full":
        return count_layers(frozen(load_policy(spec.model_path, spec.dtype, device).to(device)), work_done)
    import deepspeed

    # Loaded whole in host memory (each rank's, once, at start), then partitioned parameter by
    # parameter by zero.Init onto this rank's device -- or its host memory when offloaded -- so a
    # GPU never holds the whole model (deepspeed.initialize alone would move it there first).
    model = count_layers(
        frozen(load_policy(spec.model_path, spec.dtype, device)), work_done
    )  # (the device picks the attention kernel)
    skip_muon_import()
    offload = spec.reference_memory == "offloaded"
    config = frozen_model_config(dtype=spec.dtype, data_parallel_size=world_size, offload_params=offload)
    deepspeed.zero.Init(
        module=model,
        config_dict_or_path=config,
        remote_device="cpu" if offload else None,
        pin_memory=offload,
        mem_efficient_linear=False,
    )
    for buffer in model.buffers():  # (zero.Init moves parameters only; initialize no longer moves the model)
        buffer.data = buffer.data.to(device)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def frozen_models(
    spec: TrainerSpec, device: torch.device, world_size: int, work_done: WorkCount, reference: bool = True
) -> dict[str, torch.nn.Module]:
    """What a reference rank holds, by the name its log-probs go under (`TrainerSpec`): "ref" the
    frozen initial policy (`spec.holds_reference`; `reference=False`: the caller has it already,
    a LoRA policy's own base) and "teacher" the teacher's checkpoint (`spec.teacher_path`), each
    held as trainer.reference_memory says."""
    models = {}
    if spec.holds_reference and reference:
        models["ref"] = reference_model(spec, device, world_size, work_done)
    if spec.teacher_path is not None:
        teacher = replace(spec, model_path=spec.teacher_path, dtype=spec.teacher_dtype or spec.dtype)
        models["teacher"] = reference_model(teacher, device, world_size, work_done)
    return models


def frozen_logprobs(
    model: torch.nn.Module,
    micro_batches: Callable[[], list[PaddedBatch | PackedBatch]],
    shard: int,
    spec: TrainerSpec,
    world_size: int,
    share_prompts: bool,
    work_done: WorkCount,
) -> list[torch.Tensor]:
    """A frozen model's log-probs of the shard's sequences (`micro_batches()`), on CPU (the
    reference's, hosted or not). A sharded model's forwards are collective: the ranks first agree
    on how many they run, so a rank short of micro-batches fails every rank at once instead of
    leaving the others waiting."""
    if spec.reference_memory != "full" and world_size > 1:
        import torch.distributed as dist

        try:
            mbs, failure = micro_batches(), None
        except Exception as e:  # noqa: BLE001 - told to every rank below, then raised here
            mbs, failure = [], e
        counts = [None] * world_size
        with work_done.collective():
            dist.all_gather_object(counts, -1 if failure else len(mbs))
        if failure is not None:
            raise failure
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"shard {shard}: the sharded reference's ranks hold {counts} micro-batches (-1: failed); "
                "its forwards are collective and need as many on every rank"
            )
    else:
        mbs = micro_batches()
    return [sequence_logprobs(model, mb, spec.temperature, share_prompts).float().cpu() for mb in work_done.each(mbs)]
