"""Optimizer steps over micro-batches whose count and size vary (token-budget packing).

Count-based micro-batches give every optimizer step `train_batch / (micro x dp)` equal passes and
DeepSpeed's own gradient-accumulation counter works. Token-budget micro-batches do not divide
that way, so the worker drives the boundary itself (`set_gradient_accumulation_boundary`) and
weights each micro-batch's loss, normalised by its own denominator D_mb (`algo.losses`: action
tokens for a token mean, sequences for the seq-means), by `D_mb / D_step x dp` (D_step summed over
data-parallel ranks; DeepSpeed averages gradients over the dp ranks). The update is then the
aggregation over the optimizer step's sequences, whatever the micro-batch cut -- so the same
rollout gives the same loss and update under every transfer strategy (`tests/algo/test_oracle_matrix.py`). Ranks agree on the step
boundaries because the planners give every rank the same number of micro-batches.

Also the row view GAE needs: per-token experience of a packed micro-batch is laid out as
`[b, L-1]` rows here (on this rank, CPU) and the results go back to the packed layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import singledispatch
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from rlhf_orch.transfer.batch import TURN_REWARDS, PackedBatch, PaddedBatch
from rlhf_orch.transfer.micro_batches import near_equal_ranges


@dataclass(frozen=True)
class OptimizerStepPlan:
    step_of: tuple[int, ...]  # micro-batch position -> optimizer step
    boundaries: frozenset[int]  # positions after which the optimizer steps
    # The loss's normaliser per step, summed over data-parallel ranks: action tokens for a
    # token mean, sequences (x a constant length) for the seq-mean aggregations.
    step_denominators: tuple[float, ...]
    step_tokens: tuple[float, ...]  # action tokens per step, summed over ranks (token-mean metrics)
    world_size: int
    members: tuple[tuple[int, ...], ...] = ()  # per step, this rank's sample indices in it

    @property
    def num_steps(self) -> int:
        return len(self.step_denominators)

    def weight(self, position: int, denominator: float) -> float:
        """Weight of a micro-batch's loss normalised by its own `denominator` (its local D): its
        share of the step's loss, times the ranks (DeepSpeed averages gradients over them)."""
        return denominator * self.world_size / max(self.step_denominators[self.step_of[position]], 1e-12)

    def token_weight(self, position: int, tokens: float) -> float:
        """The same for a token mean over the micro-batch (metrics: clip fraction, KL, entropy)."""
        return tokens * self.world_size / max(self.step_tokens[self.step_of[position]], 1e-12)

    def is_boundary(self, position: int) -> bool:
        return position in self.boundaries


def all_reduce_sum(values: list[float], world_size: int) -> list[float]:
    """Sum over the data-parallel ranks of this process group (identity with one rank)."""
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def action_tokens(mb: Any) -> float:
    return float(mb.action_mask.sum())


def plan_optimizer_steps(
    mbs: Sequence[Any], train_batch_size: int, world_size: int, denominator: Callable[[Any], float] = action_tokens
) -> OptimizerStepPlan:
    """Steps per epoch = rollout sequences (all ranks) / train_batch_size, at least 1, at most
    one per micro-batch; micro-batches are grouped contiguously. `denominator(mb)` is a
    micro-batch's share of its step's loss normaliser (default: its action tokens, a token mean)."""
    if not mbs:
        raise ValueError("no micro-batches to train on")
    sequences = sum(int((mb.indices >= 0).sum()) for mb in mbs)  # stand-ins for empty micro-batches have index -1
    (global_sequences,) = all_reduce_sum([sequences], world_size)
    num_steps = max(1, min(len(mbs), int(round(global_sequences)) // max(train_batch_size, 1)))
    groups = near_equal_ranges(len(mbs), num_steps)
    local = [sum(denominator(mbs[p]) for p in g) for g in groups] + [
        sum(action_tokens(mbs[p]) for p in g) for g in groups
    ]
    summed = all_reduce_sum(local, world_size)
    members = tuple(tuple(int(i) for p in g for i in mbs[p].indices.tolist() if i >= 0) for g in groups)
    step_of = tuple(k for k, g in enumerate(groups) for _ in g)
    return OptimizerStepPlan(
        step_of,
        frozenset(g[-1] for g in groups),
        tuple(summed[:num_steps]),
        tuple(summed[num_steps:]),
        world_size,
        members,
    )


# --------------------------------------------------------------------------- rows for GAE
@singledispatch
def _as_rows(mb: Any, fields: dict[str, Tensor], pad_id: int) -> PaddedBatch:
    raise TypeError(type(mb).__name__)


@_as_rows.register
def _(mb: PaddedBatch, fields: dict[str, Tensor], pad_id: int) -> PaddedBatch:
    return dataclasses.replace(mb.to("cpu"), fields={k: v.cpu() for k, v in fields.items()})


@_as_rows.register
def _(mb: PackedBatch, fields: dict[str, Tensor], pad_id: int) -> PaddedBatch:
    return dataclasses.replace(mb.to("cpu"), fields={k: v.cpu() for k, v in fields.items()}).to_padded(pad_id)


def padded_rows(mb: Any, fields: dict[str, Tensor], pad_id: int) -> PaddedBatch:
    """A micro-batch of either layout as right-padded rows on the CPU, with `fields` ([.., L-1] in its layout)."""
    return _as_rows(mb, fields, pad_id)


def rows_for_targets(mbs: Sequence[Any], per_token: dict[str, Sequence[Tensor]], pad_id: int) -> list[PaddedBatch]:
    """Each micro-batch as rows with `per_token` (name -> one tensor per micro-batch, in its
    layout), and the fields the estimators read from the rollout itself (`TURN_REWARDS`) where the
    micro-batch carries them."""
    rows = []
    for k, mb in enumerate(mbs):
        carried = {name: mb.fields[name] for name in (TURN_REWARDS,) if name in mb.fields}
        rows.append(_as_rows(mb, {**{name: v[k] for name, v in per_token.items()}, **carried}, pad_id))
    return rows


@singledispatch
def targets_in_layout(mb: Any, rows: PaddedBatch, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    raise TypeError(type(mb).__name__)


@targets_in_layout.register
def _(mb: PaddedBatch, rows: PaddedBatch, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.to(mb.input_ids.device) for k, v in tensors.items()}


@targets_in_layout.register
def _(mb: PackedBatch, rows: PaddedBatch, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    packed = dataclasses.replace(rows, fields=dict(tensors)).to_packed()
    return {k: v.to(mb.input_ids.device) for k, v in packed.fields.items()}
