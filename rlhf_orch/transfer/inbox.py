"""Trainer-side receiving end of every strategy: the micro-batches a rank holds, by shard.

Mixed into trainer actors (and the benchmark's sink actors). Each entry point takes what one
strategy sends; all of them end in `self._staged[shard] = [micro-batch, ...]` in slot order.
Data arrives actor to actor: a top-level ObjectRef argument is resolved by Ray in this process,
and refs nested in a list are fetched here with `ray.get` -- never through the driver.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import ray
import torch

from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, apply_loss_mask

MicroBatch = PaddedBatch | PackedBatch


def empty_micro_batch(pad_id: int) -> PackedBatch:
    """Stand-in for a planned EMPTY micro-batch: one pad token, no action.

    Data-parallel ranks must run the same number of forward/backward passes; this gives a rank
    with fewer sequences than micro-batches something to run whose loss is exactly 0 (no action
    token), while its gradients and collectives still line up. Its index is -1 (no sample).
    """
    return PackedBatch(
        input_ids=torch.tensor([pad_id]),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        position_ids=torch.zeros(1, dtype=torch.long),
        action_mask=torch.zeros(1, dtype=torch.bool),
        scores=torch.zeros(1),
        indices=torch.tensor([-1]),
        weight_versions=torch.zeros(1, dtype=torch.long),
    )


def assemble_packed(
    pieces: Sequence[PackedBatch | None], plan: Sequence[Sequence[int]], pad_id: int
) -> list[PackedBatch]:
    """This rank's micro-batches from the engines' pieces, following `plan` (global indices).

    Each piece lists its sequences micro-batch after micro-batch (`cut_for_ranks`); its part of
    micro-batch k is a view. A micro-batch that lies within one piece IS that view (no copy: the
    planner keeps micro-batches within one engine where it can); one that spans pieces is the
    concatenation of their parts (one copy). A view keeps its piece's buffer (the object-store
    mapping) alive as long as it lives; each micro-batch has its own `fields` dict, so a trainer
    may add fields to it, but never writes into its tensors.
    """
    micro_batch_of = {i: k for k, mb in enumerate(plan) for i in mb}
    parts: list[list[PackedBatch]] = [[] for _ in plan]
    for piece in pieces:
        if piece is None:
            continue
        owners = [micro_batch_of.get(int(i), -1) for i in piece.indices.tolist()]
        if -1 in owners or owners != sorted(owners):
            raise ValueError("a piece holds unplanned samples or is not in micro-batch order")
        counts = torch.bincount(torch.tensor(owners, dtype=torch.long), minlength=len(plan)).tolist()
        starts = [sum(counts[:k]) for k in range(len(plan))]
        for k, part in enumerate(piece.split([range(s, s + c) for s, c in zip(starts, counts)])):
            if len(part):
                parts[k].append(part)
    out = []
    for k, mb in enumerate(plan):
        if len(parts[k]) == 1:
            batch = parts[k][0]  # a view of the piece
        else:
            batch = PackedBatch.concat(parts[k]) if parts[k] else empty_micro_batch(pad_id)
        if batch.indices.tolist() != ([-1] if not mb else list(mb)):
            raise ValueError(
                f"micro-batch {k}: pieces hold {batch.indices.tolist()[:8]}..., the plan {list(mb)[:8]}..."
            )
        out.append(batch)
    return out


def staged_micro_batches(staged: dict[int, list[Any]], shard: int) -> list[MicroBatch]:
    """The micro-batches of `shard` in `staged`, every streamed one arrived (else refused)."""
    mbs = staged[shard]
    if any(mb is None for mb in mbs):
        raise RuntimeError(f"shard {shard}: {sum(mb is None for mb in mbs)} streamed micro-batches never arrived")
    return mbs


def arrived(mb: MicroBatch, device: torch.device | None) -> MicroBatch:
    """What a staged micro-batch becomes on arrival: observation tokens leave the action mask
    (multi-turn rollouts), then it moves to the rank's `device` (a trainer's; None: it stays)."""
    mb = apply_loss_mask(mb)
    return mb if device is None else mb.to(device)


class ExperienceInbox:
    """The receiving end, mixed into an actor: its `_staged` micro-batches by shard, `pad_id` for
    the stand-ins of empty micro-batches, `device` where arriving micro-batches go."""

    pad_id: int
    device: torch.device | None = None
    _staged: dict[int, list[Any]]

    def stage(self, shard: int, micro_batches: list[MicroBatch]) -> int:
        """The whole shard at once (the padded baseline; Ray resolved the ref into the list)."""
        self._staged[shard] = [arrived(mb, self.device) for mb in micro_batches]
        return sum(mb.nbytes for mb in micro_batches)

    def stage_micro_batch(self, shard: int, slot: int, num_slots: int, mb: MicroBatch) -> int:
        """One streamed micro-batch (Ray resolved the engine's ref: fetched actor to actor)."""
        slots = self._staged.setdefault(shard, [None] * num_slots)
        if len(slots) != num_slots or slots[slot] is not None:
            raise ValueError(f"shard {shard} slot {slot}/{num_slots} staged twice or with another slot count")
        slots[slot] = arrived(mb, self.device)
        return mb.nbytes

    def stage_pieces(self, shard: int, plan: list[list[int]], pieces: list[ray.ObjectRef]) -> int:
        """Packed: fetch this rank's piece from every engine, cut the planned micro-batches."""
        start = time.time()
        fetched = ray.get(list(pieces))
        got = time.time()
        self._staged[shard] = [arrived(mb, self.device) for mb in assemble_packed(fetched, plan, self.pad_id)]
        self._last_stage = {"start": start, "fetched": got, "assembled": time.time()}
        return sum(p.nbytes for p in fetched if p is not None)

    def last_stage_timing(self) -> dict[str, float]:
        """Wall-clock stamps of the last `stage_pieces` (a profile of the hand-over)."""
        return dict(getattr(self, "_last_stage", {}))

    def staged_count(self, shard: int) -> int:
        return sum(mb is not None for mb in self._staged.get(shard, []))

    def drop_staged(self) -> None:
        self._staged.clear()
