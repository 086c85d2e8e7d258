"""The critic's Ray actor (one data-parallel rank of the value model, DeepSpeed) and its update:
`ppo_epochs` passes of the clipped value loss (`train_values`, a plain function)."""

from __future__ import annotations

import torch

from rlhf_orch.algo.losses import aggregate_loss, clipped_value_loss
from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.accumulation import Accumulation
from rlhf_orch.trainer.forward import enable_gradient_checkpointing, load_critic, sequence_values, shares_prompts
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.progress import counting_saved_tensors
from rlhf_orch.trainer.spec import TrainerSpec, respecced
from rlhf_orch.trainer.token_weighting import plan_optimizer_steps
from rlhf_orch.trainer.training_engine import training_engine
from rlhf_orch.trainer.weight_source import ModuleWeightSource
from rlhf_orch.trainer.worker import TrainerWorker
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch
from rlhf_orch.transfer.inbox import staged_micro_batches


class CriticWorker(TrainerWorker):
    """One data-parallel rank of the value model."""

    role = "critic"

    def build(self, spec: TrainerSpec | None = None) -> int:
        self.spec = respecced(self.spec, spec, self.role, self.world_size)
        model = load_critic(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        if self.spec.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.engine = training_engine(model, self.spec, self.work_done)
        self.checkpoint_weights = ModuleWeightSource(self.engine.module, self.spec.zero_stage)
        self._old_values: dict[int, list[torch.Tensor]] = {}
        return sum(p.numel() for p in model.parameters())

    @ends_a_phase
    @torch.no_grad()
    def values(self, shard: int) -> list[torch.Tensor]:
        self.engine.eval()
        share = shares_prompts(self.spec.share_prompts, self.device)
        vals = [
            sequence_values(self.engine, mb, share).float()
            for mb in self.work_done.each(staged_micro_batches(self._staged, shard))
        ]
        self._old_values[shard] = vals
        return [v.cpu() for v in vals]

    @ends_a_phase
    def train(self, returns_by_shard: dict[int, list[torch.Tensor]]) -> dict[str, float]:
        """`ppo_epochs` passes of the clipped value loss, a token mean over each optimizer step."""
        import ray

        # Refs nested in a dict are not resolved by Ray: fetch them here, worker to worker.
        returns_by_shard = {s: ray.get(r) if isinstance(r, ray.ObjectRef) else r for s, r in returns_by_shard.items()}
        work = [
            (mb, old_v, ret)
            for shard, returns in sorted(returns_by_shard.items())
            for mb, old_v, ret in zip(staged_micro_batches(self._staged, shard), self._old_values[shard], returns)
        ]
        stats, self.last_step_members = train_values(
            self.engine,
            work,
            self.spec,
            self.world_size,
            shares_prompts(self.spec.share_prompts, self.device),
            self.device,
            self.work_done,
        )
        self.drop_staged()
        self._old_values.clear()
        return stats


def train_values(
    engine,
    work: list[tuple[PaddedBatch | PackedBatch, torch.Tensor, torch.Tensor]],
    spec: TrainerSpec,
    world_size: int,
    share_prompts: bool,
    device: torch.device,
    work_done: WorkCount,
) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    """`ppo_epochs` passes of the clipped value loss over `work` ((micro-batch, old values, returns)
    per micro-batch), a token mean over each optimizer step. Returns the stats and, per optimizer
    step (all epochs), the sample indices this rank trained on in it."""
    engine.train()
    plan = plan_optimizer_steps([mb for mb, _, _ in work], spec.train_batch_size, world_size)
    accumulation = Accumulation(engine, work_done)
    members = list(plan.members) * spec.ppo_epochs
    total, clip = 0.0, 0.0
    for _ in range(spec.ppo_epochs):
        for position, (mb, old_v, ret) in enumerate(work_done.each(work)):
            with counting_saved_tensors(work_done):  # (its backward moves the count too)
                values = sequence_values(engine, mb, share_prompts)
            loss_mat, stats = clipped_value_loss(values, old_v, ret.to(device), mb.action_mask, spec.clip_eps)
            tokens = float(mb.action_mask.sum())
            loss = aggregate_loss(loss_mat, mb.action_mask, "token-mean")
            weight = plan.weight(position, tokens)
            total += accumulation.backward(plan, position, loss, weight)
            clip += float(stats["vf_clipfrac"]) * weight
    steps = plan.num_steps * spec.ppo_epochs
    return accumulation.with_grad_norm({"value_loss": total / steps, "vf_clipfrac": clip / steps}), members
