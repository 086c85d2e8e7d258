"""The sequences a policy rank trained on, as the rollout dump shows them (logger.rollouts)."""

from __future__ import annotations

from typing import Iterable

from rlhf_orch.trainer.token_weighting import padded_rows
from rlhf_orch.transfer.batch import TURN_REWARDS, PackedBatch, PaddedBatch, model_turn_spans


def trained_sequences(mbs: Iterable[PaddedBatch | PackedBatch], indices: list[int], pad_id: int) -> list[dict]:
    """The sequences `indices` of the micro-batches `mbs` as this rank trained them: token ids,
    which positions are model tokens (`action`), the mean advantage over them and over each model
    turn, each turn's placed reward (env.reward=per_turn), the weights that drew them (after
    make_experience, which set the advantages)."""
    wanted = set(indices)
    out = []
    for mb in mbs:
        if not wanted & set(mb.indices.tolist()):
            continue
        carried = {name: mb.fields[name] for name in ("advantages", TURN_REWARDS) if name in mb.fields}
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
            }
            if TURN_REWARDS in rows.fields:
                placed = rows.fields[TURN_REWARDS][r, : length - 1]
                seq["turn_rewards"] = [round(float(placed[a:b].sum()), 6) for a, b in turns]
            out.append(seq)
    return out
