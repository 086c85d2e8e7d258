"""The `trainer` section's declarations: DeepSpeed settings shared by actor and critic
(`rlhf_orch.trainer.spec`, used by `rlhf_orch.trainer.worker`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import II

# The values trainer.old_logprobs takes (rlhf_orch.trainer.old_logprobs decides what "auto" does).
OLD_LOGPROBS_MODES = ("auto", "forward")


@dataclass
class TrainerConfig:
    """DeepSpeed settings shared by actor and critic."""

    # DeepSpeed ZeRO stage of the trained roles (conf/config.yaml sets 2). A role of one rank runs 1
    # and 2 as stage 0 unless its optimizer is offloaded: nothing to partition, and ZeRO's flat fp32
    # copy of the weights and gradient buckets would be held for nothing (zero_stage_to_run).
    zero_stage: int = 0
    # Optimizer states, fp32 master weights and gradients in host memory (DeepSpeed ZeRO-Offload):
    # GPU memory for slower steps. GPU layouts only (on CPU they are in host memory already).
    offload_optimizer: bool = False
    # Recompute each layer's activations in the backward pass instead of keeping them (HF's
    # gradient checkpointing): activation memory ~1/layers for ~30 % more trainer compute.
    gradient_checkpointing: bool = False
    # How each reference rank holds its frozen models (the KL reference, the teacher): "full" (a whole copy per reference rank), "sharded"
    # (DeepSpeed ZeRO-3 over the reference ranks -- the policy ranks when it lives in their
    # processes: 1/ranks of the weights each, a layer gathered at a time), "offloaded" (sharded, the
    # shards in host memory; GPU layouts). What a policy too large for a whole reference per GPU needs.
    reference_memory: str = "full"
    # A packed micro-batch's samples of one prompt (GRPO's group) run it once: each response attends
    # to the one copy (rlhf_orch.trainer.shared_prompts; same log-probs, values and gradients).
    # null = on with transfer=packed (padded micro-batches keep a row per sequence); false = off.
    # Where the trainers load flash-attention's varlen kernels (CUDA with flash_attn) it is off:
    # they take whole sequences only. On CUDA the row's attention is two padded SDPA calls a layer,
    # used where the row is at least 25 % shorter (else the plain row runs; measured on an H200);
    # on CPU one call per branch, used at any saving. Exact with attention dropout 0 (the branches
    # would share the prompt's dropout mask otherwise).
    share_prompts: Optional[bool] = None
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # "adamw" (betas 0.9, 0.95) or "sgd" (plain: the update is lr x gradient)
    # Torch threads of each trainer process (actor, critic, reference, reward model). On CPU, Ray gives
    # an actor one core; under pipeline=sync the engine waits while the trainers train, so a
    # trainer may use that core too (2 on a 2-core machine: SmolLM2's training phase 1.8x faster).
    torch_threads: int = 1
    # Where the policy's old log-probs (pi_old) come from: "auto" takes them from the update's own
    # forward, detached (as TRL does), where that is exact -- one optimizer step per rollout
    # (algo.ppo_epochs=1, algo.train_batch_size >= the rollout's sequences), no KL in the reward
    # (it reads them before the update) and no dropout in the trained model (its config's *dropout*,
    # LoRA's) -- and otherwise runs the experience phase's own forward, without gradients; "forward"
    # always runs it. Skipping it saves a forward of every sequence a step (SmolLM2 generation-heavy:
    # ~40 % of the step); rlhf_orch/trainer/old_logprobs.py decides, per step.
    old_logprobs: str = "auto"
    seed: int = II("seed")  # the trainers' torch/NumPy/Python RNG (dropout, init); the run's `seed` unless set here
