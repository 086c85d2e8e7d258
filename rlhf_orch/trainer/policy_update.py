"""The policy's PPO update on one rank: `ppo_epochs` passes of the policy loss over its staged
micro-batches (`train_policy`), and the per-token loss of one micro-batch (`policy_token_loss`).
Where the experience phase left the old log-probs to the update (`old_logprobs`), its own
forward's, detached, are pi_old, and the update measures their statistics (`old_logprob_stats`)."""

from __future__ import annotations

import math

import torch

from rlhf_orch.algo.estimators import Algorithm
from rlhf_orch.algo.losses import (
    aggregate_loss,
    clipped_policy_loss,
    decoupled_is_weights,
    kl_divergence,
    loss_denominator,
    truncated_is_weights,
)
from rlhf_orch.algo.ppo_math import masked_mean
from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.accumulation import Accumulation
from rlhf_orch.trainer.experience import old_logprob_stats
from rlhf_orch.trainer.forward import sequence_logprobs_and_entropy
from rlhf_orch.trainer.progress import counting_saved_tensors
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.trainer.token_weighting import plan_optimizer_steps
from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, PackedBatch, PaddedBatch


def train_policy(
    engine,
    mbs: list[PaddedBatch | PackedBatch],
    algo: Algorithm,
    norm_len: int,
    spec: TrainerSpec,
    world_size: int,
    share_prompts: bool,
    work_done: WorkCount,
    old_from_update: bool,
) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    """`ppo_epochs` passes of the policy loss (clipped surrogate + KL in the loss - entropy).
    Returns the stats and, per optimizer step, the sample indices this rank trained on in it.

    `old_from_update`: make_experience computed no old log-probs (`old_logprobs_from_update`): each
    micro-batch's own forward, detached, is pi_old -- exact for one epoch of one optimizer step
    only, so any other plan is refused here rather than trained on wrongly; the stats then carry
    `OLD_LOGPROB_STATS` (the engine-vs-trainer mismatch, the KL to the reference) of that forward.

    The loss is aggregated as `algo.loss_agg` says, normalised over each optimizer step's
    whole batch (all micro-batches, all ranks: `plan_optimizer_steps`), so the update does not
    depend on how the batch was cut. Micro-batches are reshuffled between epochs (the same
    permutation on every rank, a new one every step). `rlhf_orch.algo.oracle` is this update
    written without micro-batches or ranks; `tests/algo/test_oracle_matrix.py` holds the two equal.
    """
    engine.train()
    accumulation = Accumulation(engine, work_done)
    members: list[tuple[int, ...]] = []
    totals: dict[str, float] = {}
    steps = 0
    if old_from_update and algo.ppo_epochs != 1:
        raise RuntimeError(
            f"the old log-probs were left to the update's forward, but algo.ppo_epochs={algo.ppo_epochs}: "
            "later epochs would take moved weights for pi_old"
        )
    old: list[torch.Tensor] = []  # (old_from_update) each micro-batch's detached log-probs, in order

    def denominator(mb: PaddedBatch | PackedBatch) -> float:
        """The micro-batch's share of its step's loss normaliser (`algo.losses.loss_denominator`)."""
        return float(loss_denominator(mb.action_mask, algo.loss_agg, norm_len, mb.sequence_ids))

    for epoch in range(algo.ppo_epochs):
        order = list(range(len(mbs)))
        if epoch:  # the same permutation on every rank: only the count per step must agree
            seed = (spec.seed * 1_000_003 + int(engine.global_steps)) * 101 + epoch
            order = torch.randperm(len(mbs), generator=torch.Generator().manual_seed(seed)).tolist()
        epoch_mbs = [mbs[i] for i in order]
        plan = plan_optimizer_steps(
            epoch_mbs,
            spec.train_batch_size,
            world_size,
            denominator,
        )
        if old_from_update and plan.num_steps != 1:
            raise RuntimeError(
                f"the old log-probs were left to the update's forward, but the update plans {plan.num_steps} "
                "optimizer steps: later steps would take moved weights for pi_old"
            )
        steps += plan.num_steps
        members += plan.members
        for position, mb in enumerate(work_done.each(epoch_mbs)):
            with counting_saved_tensors(work_done):  # (its backward moves the count too)
                loss_mat, stats, logprobs = policy_token_loss(
                    engine, mb, algo, spec.temperature, share_prompts, old_from_update
                )
            if old_from_update:
                old.append(logprobs)
            local = denominator(mb)
            loss = aggregate_loss(
                loss_mat, mb.action_mask, algo.loss_agg, denominator=local, sequence_ids=mb.sequence_ids
            )
            totals["policy_loss"] = totals.get("policy_loss", 0.0) + accumulation.backward(
                plan, position, loss, plan.weight(position, local)
            )
            # Token means over the step's action tokens, whatever the loss aggregation and the cut.
            token_weight = plan.token_weight(position, float(mb.action_mask.sum()))
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value) * token_weight
    # Per optimizer step (normalised as the loss), averaged over steps and epochs.
    per_step = accumulation.with_grad_norm({k: v / max(steps, 1) for k, v in totals.items()})
    if old_from_update:  # (one epoch: `old` follows `mbs`)
        ref = [mb.fields["ref_logprobs"] for mb in mbs] if algo.kl_in_loss else None
        per_step.update(old_logprob_stats(mbs, old, ref))
        for mb, logprobs in zip(mbs, old):  # pi_old as the rollout dump reads it (`trained_sequences`)
            mb.fields["old_logprobs"] = logprobs
    return per_step, members


def policy_token_loss(
    model,
    mb: PaddedBatch | PackedBatch,
    algo: Algorithm,
    temperature: float,
    share_prompts: bool,
    old_from_update: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The per-token policy loss of one micro-batch, its token-mean statistics and its log-probs
    (detached, float32). `old_from_update`: those log-probs are pi_old (`train_policy`)."""
    logprobs, entropy = sequence_logprobs_and_entropy(
        model, mb, temperature, entropy=algo.entropy_coef > 0, share_prompts=share_prompts
    )
    mask = mb.action_mask
    detached = logprobs.detach().float()
    old_logprobs = detached if old_from_update else mb.fields["old_logprobs"]
    # The engine's log-probs are the behaviour policy (stale under one_step_off); old_logprobs
    # the proximal one the clip is against. At most one correction is set (validate refuses both).
    is_weights = None
    if algo.tis_cap is not None:
        is_weights = truncated_is_weights(old_logprobs, mb.fields[ENGINE_LOGPROBS], mask, algo.tis_cap)
    elif algo.decoupled_is_cap is not None:
        is_weights = decoupled_is_weights(old_logprobs, mb.fields[ENGINE_LOGPROBS], mask, algo.decoupled_is_cap)
    loss_mat, stats = clipped_policy_loss(
        logprobs,
        old_logprobs,
        mb.fields["advantages"],
        mask,
        algo.clip_low,
        algo.clip_high,
        algo.loss_agg,
        is_weights,
        algo.clip_ratio_c,
    )
    stats = {k: stats[k] for k in ("clipfrac", "approx_kl", "clipfrac_dual") if k in stats}
    if algo.tis_cap is not None:
        stats["tis_weight"] = masked_mean(is_weights, mask)
        stats["tis_capped"] = masked_mean((is_weights >= algo.tis_cap * (1 - 1e-6)).to(is_weights.dtype), mask)
    elif algo.decoupled_is_cap is not None:
        stats["decoupled_weight"] = masked_mean(is_weights, mask)  # dropped tokens count as 0
        # Dropped: the weight exceeds the cap (tested as decoupled_is_weights does, on the log-ratio).
        above_cap = (old_logprobs - mb.fields[ENGINE_LOGPROBS]) > math.log(algo.decoupled_is_cap)
        stats["decoupled_dropped"] = masked_mean(above_cap.to(is_weights.dtype), mask)
    if algo.kl_in_loss:
        kl = kl_divergence(logprobs, mb.fields["ref_logprobs"], algo.kl_estimator, mask=mask)
        loss_mat = loss_mat + algo.kl_coef * kl
        stats["kl_loss"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        loss_mat = loss_mat - algo.entropy_coef * entropy
        stats["entropy"] = masked_mean(entropy.detach(), mask)
    return loss_mat, stats, detached
