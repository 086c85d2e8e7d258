"""What every trainer-side process needs (`TrainerSpec`), built on the driver from the config."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_orch.models.lora import LoraSettings


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer-side process needs; built on the driver from the config
    (`rlhf_orch.orchestration.session.trainer_specs`). The trainer.* knobs carry no default here:
    their defaults are the config's."""

    model_path: str
    dtype: str
    zero_stage: int
    micro_batch_size: int
    train_batch_size: int
    data_parallel_size: int
    pad_id: int
    temperature: float
    lr: float
    weight_decay: float
    grad_clip: float
    clip_eps: float
    ppo_epochs: int
    seed: int
    torch_threads: int  # trainer.torch_threads
    optimizer: str  # trainer.optimizer: "adamw" or "sgd" (plain, no momentum)
    reference_memory: str  # trainer.reference_memory: full, sharded (ZeRO-3) or offloaded
    offload_optimizer: bool = False  # trainer.offload_optimizer (ZeRO-Offload; GPU layouts)
    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    host_reference: bool = False  # the policy rank also holds the reference (plan.reference_in_actor)
    # The frozen models of a reference rank (or of a policy rank hosting it), each held only where
    # the algorithm reads it: the KL reference (the initial policy: a KL term) and the teacher
    # (teacher=<model option>: its checkpoint and dtype; algo.distill_coef).
    holds_reference: bool = True
    teacher_path: str | None = None
    teacher_dtype: str | None = None
    share_prompts: bool = False  # trainer.share_prompts: packed micro-batches run a repeated prompt once
    old_logprobs: str = "auto"  # trainer.old_logprobs: "auto" (from the update's forward where exact) or "forward"
    # model.lora (its sync resolved to adapter or merged): the policy trains adapters on a frozen
    # base (rlhf_orch.trainer.lora); None: every weight trains.
    lora: LoraSettings | None = None
    # The process shares its GPU with others of the run (`PlacementPlan.shares_gpu`): it gives its
    # cached CUDA memory back as each phase ends (rlhf_orch/trainer/phase_memory.py).
    free_cache_between_phases: bool = False


def respecced(current: TrainerSpec, new: TrainerSpec | None, role: str, world_size: int) -> TrainerSpec:
    """The spec a rank of `role` in a group of `world_size` ranks runs with after being handed `new`
    (None: keeps `current`); another data-parallel size is refused (the ranks' world stays)."""
    if new is None:
        return current
    if new.data_parallel_size != world_size:
        raise ValueError(
            f"a {role} group of {world_size} ranks cannot take data_parallel_size={new.data_parallel_size}"
        )
    return new
