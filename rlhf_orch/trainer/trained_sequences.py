"""The sequences a policy rank trained on, as the rollout dump shows them (logger.rollouts)."""

from __future__ import annotations

from typing import Iterable

from rlhf_orch.trainer.token_weighting import padded_rows
from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, TURN_REWARDS, PackedBatch, PaddedBatch, model_turn_spans

# The trainer's log-probs of the sampled tokens: pi_old, from make_experience's forward or, where
# the update's own forward stands for it (`old_logprobs_from_update`), set by `train_policy`.
TRAINER_LOGPROBS = "old_logprobs"
# Per-token values in the dump are rounded: they are read by people, and a 1000-step dump stays small.
_DIGITS = 4


def _per_token(values, length: int) -> list[float]:
    """A field's values at positions 0..length-2 as per-token values of tokens 1..length-1 (position
    t predicts token t+1), token 0 (never predicted) as 0."""
    return [0.0] + [round(float(v), _DIGITS) for v in values[: length - 1].tolist()]


def trained_sequences(mbs: Iterable[PaddedBatch | PackedBatch], indices: list[int], pad_id: int) -> list[dict]:
    """The sequences `indices` of the micro-batches `mbs` as this rank trained them: token ids,
    which positions are model tokens (`action`), the mean advantage over them and over each model
    turn, each turn's placed reward (env.reward=per_turn), the weights that drew them, and per
    token (aligned with `ids`, token t's value at t): the advantage it was trained with, the
    engine's sampling log-prob and the trainer's log-prob of it (None where the rank has none).
    Called after make_experience (which set the advantages); after the update for the trainer's
    log-probs when the update's forward made them."""
    wanted = set(indices)
    out = []
    for mb in mbs:
        if not wanted & set(mb.indices.tolist()):
            continue
        names = ("advantages", TURN_REWARDS, ENGINE_LOGPROBS, TRAINER_LOGPROBS)
        carried = {name: mb.fields[name] for name in names if name in mb.fields}
        rows = padded_rows(mb, carried, pad_id)
        for r, index in enumerate(rows.indices.tolist()):
            if index not in wanted:
                continue
            length = int(rows.attention_mask[r].sum())
            action = rows.action_mask[r, : length - 1].bool()
            advantages = rows.fields["advantages"][r, : length - 1]
            turns = model_turn_spans(action.tolist())
            seq = {
                "index": index,
                "ids": rows.input_ids[r, :length].tolist(),
                "action": [0] + action.int().tolist(),  # position t: token t is the model's
                "advantage": float(advantages[action].float().mean()) if action.any() else 0.0,
                "turn_advantages": [float(advantages[a:b].float().mean()) for a, b in turns],
                "weight_version": int(rows.weight_versions[r]),
                "token_advantages": _per_token(advantages, length),
                "engine_logprobs": (
                    _per_token(rows.fields[ENGINE_LOGPROBS][r], length) if ENGINE_LOGPROBS in rows.fields else None
                ),
                "trainer_logprobs": (
                    _per_token(rows.fields[TRAINER_LOGPROBS][r], length) if TRAINER_LOGPROBS in rows.fields else None
                ),
            }
            if TURN_REWARDS in rows.fields:
                placed = rows.fields[TURN_REWARDS][r, : length - 1]
                seq["turn_rewards"] = [round(float(placed[a:b].sum()), 6) for a, b in turns]
            out.append(seq)
    return out
