"""The DeepSpeed engine a trained role (policy, critic) runs: its optimizer as trainer.optimizer
says, its config from `deepspeed_config`, its decoder layers counted for the liveness check."""

from __future__ import annotations

import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.deepspeed_config import deepspeed_config
from rlhf_orch.trainer.deepspeed_startup import skip_muon_import
from rlhf_orch.trainer.progress import count_layers
from rlhf_orch.trainer.spec import TrainerSpec


def training_engine(model: torch.nn.Module, spec: TrainerSpec, work_done: WorkCount):
    """`model` wrapped by DeepSpeed with an optimizer over its trainable parameters."""
    import deepspeed

    skip_muon_import()

    params = [p for p in model.parameters() if p.requires_grad]
    if spec.optimizer == "sgd":  # plain SGD: an update proportional to the gradient (scale errors show)
        optimizer = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    config = deepspeed_config(
        zero_stage=spec.zero_stage,
        micro_batch_size=spec.micro_batch_size,
        train_batch_size=spec.train_batch_size,
        data_parallel_size=spec.data_parallel_size,
        grad_clip=spec.grad_clip,
        dtype=spec.dtype,
        offload_optimizer=spec.offload_optimizer,
    )
    engine, *_ = deepspeed.initialize(model=count_layers(model, work_done), optimizer=optimizer, config=config)
    return engine
