"""The policy rank's experience of one shard: old log-probs by its own forward (unless the
update's own forward gives them: `old_logprobs.old_logprobs_from_update`), then the algorithm's
token targets, the frozen models' log-probs (the reference's, the teacher's), the critic's values and the driver's per-sample values
(`make_experience`), written into the staged micro-batches for the update; and the
trainer/inference log-prob mismatch of the same tokens (`old_logprob_stats`, measured where the
old log-probs are computed)."""

from __future__ import annotations

from typing import Sequence

import torch

from rlhf_orch.algo.estimators import Algorithm, TargetRows
from rlhf_orch.algo.losses import kl_divergence
from rlhf_orch.algo.ppo_math import LOGPROB_DIFF_THRESHOLD
from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.forward import sequence_logprobs
from rlhf_orch.trainer.old_logprobs import active_dropout, old_logprobs_from_update
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.trainer.token_weighting import (
    all_reduce_sum,
    plan_optimizer_steps,
    rows_for_targets,
    targets_in_layout,
)
from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, TURN_REWARDS, PackedBatch, PaddedBatch


def make_experience(
    engine,
    mbs: list[PaddedBatch | PackedBatch],
    frozen: dict[str, list[torch.Tensor]] | None,
    values: list[torch.Tensor] | None,
    algo: Algorithm,
    sample_values: dict[int, float],
    spec: TrainerSpec,
    device: torch.device,
    world_size: int,
    share_prompts: bool,
    work_done: WorkCount,
) -> tuple[dict[str, float], list[torch.Tensor], bool]:
    """Old logprobs, then the algorithm's token targets. Returns stats, the critic's returns, and
    whether the update's own forward is to give the old log-probs (then none were computed here:
    `train_policy` takes that decision and holds the update to it).

    `sample_values` (sample index -> value) is what the algorithm computed on the driver from
    the final scores: the score itself (PPO, REINFORCE++), a group-centred score, or the
    advantage (GRPO, RLOO, DAPO). `frozen`: what the reference ranks computed (`ReferenceWorker.logprobs`,
    `PolicyWorker.reference_logprobs`: "ref" the KL reference's, "teacher" the teacher's, as
    `AlgoConfig.frozen_models` names them), None without them; `values` None without a
    critic. Batch-wide normalisation is over all policy ranks (they all call this).
    """
    engine.eval()
    dropout = active_dropout(engine.module)
    # The update's optimizer steps decide only where nothing else already asks for the forward
    # (forward mode, epochs, KL in the reward, dropout): then the plan's two all-reduces are not made.
    reads_old = {"kl_in_reward": algo.kl_in_reward, "teacher": algo.uses_teacher}
    from_update, _ = old_logprobs_from_update(spec.old_logprobs, algo.ppo_epochs, 1, dropout=dropout, **reads_old)
    if from_update:
        with work_done.collective():  # (the plan sums the sequences over the ranks)
            steps = plan_optimizer_steps(mbs, spec.train_batch_size, world_size).num_steps
        from_update, _ = old_logprobs_from_update(
            spec.old_logprobs, algo.ppo_epochs, steps, dropout=dropout, **reads_old
        )
    old = (
        None
        if from_update
        else [sequence_logprobs(engine, mb, spec.temperature, share_prompts).float() for mb in work_done.each(mbs)]
    )
    frozen = {name: [lp.to(device) for lp in per_mb] for name, per_mb in (frozen or {}).items()}
    ref, teacher = frozen.get("ref"), frozen.get("teacher")
    vals = [v.to(device) for v in values] if values is not None else None
    # Targets run along each sequence: on [b, L-1] rows (packed micro-batches are unpacked
    # here, in this process, for this math only); results go back to the mb's layout.
    per_token = {"old": old, **frozen, "values": vals}
    rows = rows_for_targets(mbs, {k: v for k, v in per_token.items() if v is not None}, spec.pad_id)
    target_rows = [
        TargetRows(
            mask=r.action_mask,
            sample_values=torch.tensor([sample_values.get(int(i), 0.0) for i in r.indices], dtype=torch.float32),
            old_logprobs=r.fields.get("old"),
            ref_logprobs=r.fields.get("ref"),
            values=r.fields.get("values"),
            turn_rewards=r.fields.get(TURN_REWARDS),
            teacher_logprobs=r.fields.get("teacher"),
        )
        for r in rows
    ]

    def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:
        with work_done.collective():
            return torch.tensor(all_reduce_sum(t.tolist(), world_size), dtype=t.dtype)

    targets = algo.targets(target_rows, summed_over_ranks)
    returns = []
    for k, (mb, r, t) in enumerate(zip(mbs, rows, targets)):
        wanted = {"advantages": t.advantages}
        if t.returns is not None:
            wanted["returns"] = t.returns
        in_layout = targets_in_layout(mb, r, wanted)
        if old is not None:
            mb.fields["old_logprobs"] = old[k]
        mb.fields["advantages"] = in_layout["advantages"]
        if algo.kl_in_loss:
            mb.fields["ref_logprobs"] = ref[k]
        if t.returns is not None:
            returns.append(in_layout["returns"].cpu())
    tokens = sum(float(r.action_mask.sum()) for r in rows)
    # The largest |advantage| (torch's max keeps a NaN, which the driver's guard then reports).
    row_max = [t.advantages[r.mask.bool()].abs().max() for r, t in zip(target_rows, targets) if r.mask.any()]
    adv_abs_max = float(torch.stack(row_max).max()) if row_max else 0.0
    # Sums, not means: the driver divides by the tokens of all ranks (`trainer.metrics`).
    stats = {
        "advantages_abs_max": adv_abs_max,
        "response_tokens": tokens,
        "values_sum": (
            sum(float(torch.where(r.mask.bool(), r.values, 0).sum()) for r in target_rows) if vals is not None else 0.0
        ),
        "old_logprobs_from_update": float(from_update),
    }
    if old is not None:
        stats.update(old_logprob_stats(mbs, old, ref))
    if teacher is not None:
        # (summed over action tokens: the driver divides by all ranks' tokens -> distill/reverse_kl)
        stats["distill_kl_sum"] = k1_sum(mbs, old, teacher)
    return stats, returns, from_update


def k1_sum(
    mbs: Sequence[PaddedBatch | PackedBatch], old: Sequence[torch.Tensor], other: Sequence[torch.Tensor]
) -> float:
    """The k1 KL(old || other), log old - log other, summed over the action tokens of `mbs` (each
    tensor in its micro-batch's layout): the `kl` metric's sum (other = the reference) and
    distill/reverse_kl's (other = the teacher)."""
    return sum(
        float(kl_divergence(o, x.to(o.device), "k1", mask=mb.action_mask).sum()) for mb, o, x in zip(mbs, old, other)
    )


def old_logprob_stats(
    mbs: Sequence[PaddedBatch | PackedBatch], old: Sequence[torch.Tensor], ref: Sequence[torch.Tensor] | None
) -> dict[str, float]:
    """`metrics.OLD_LOGPROB_STATS` of this rank's micro-batches `mbs` with old log-probs `old` (each in
    its micro-batch's layout) and the reference's `ref` (None without a reference): the summed k1
    KL(old || ref) over the action tokens, and the engine-vs-trainer mismatch (`logprob_mismatch`)."""
    every_diff = logprob_mismatch(mbs, old)
    return {
        "kl_sum": k1_sum(mbs, old, ref) if ref is not None else 0.0,
        "logprob_diff_max": float(every_diff.max()) if every_diff.numel() else 0.0,
        "logprob_diff_sum": float(every_diff.sum()),
        "logprob_diff_tokens": float(every_diff.numel()),
        "logprob_diff_over": float((every_diff > LOGPROB_DIFF_THRESHOLD).sum()),
    }


def logprob_mismatch(mbs: list[PaddedBatch | PackedBatch], old: list[torch.Tensor]) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| of every action token whose micro-batch carries the
    engine's sampling log-probs, concatenated (once, for the four statistics): how far the engine's
    sampling is from the trainer's recomputation of the same tokens (train/inference mismatch;
    token in / token out keeps it at float noise)."""
    diffs = [
        (lp - mb.fields[ENGINE_LOGPROBS].to(lp.device)).abs()[mb.action_mask.bool()]
        for mb, lp in zip(mbs, old)
        if ENGINE_LOGPROBS in mb.fields
    ]
    diffs = [d for d in diffs if d.numel()]
    return torch.cat(diffs) if diffs else torch.zeros(0)
