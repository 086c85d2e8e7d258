"""A trainer spec for tests that build a trainer's parts by hand: every TrainerSpec field is
required (the config's declarations hold the defaults), these are plain values for a tiny model."""

from __future__ import annotations

from rlhf_orch.trainer.spec import TrainerSpec


def plain_spec(**overrides) -> TrainerSpec:
    args = dict(
        model_path="unused",
        dtype="float32",
        zero_stage=2,
        micro_batch_size=1,
        train_batch_size=2,
        data_parallel_size=1,
        pad_id=0,
        temperature=1.0,
        lr=0.0,
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=1,
        seed=0,
        torch_threads=1,
        optimizer="adamw",
        reference_memory="full",
    )
    return TrainerSpec(**{**args, **overrides})
