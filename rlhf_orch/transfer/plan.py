"""Pure planning of who generates what and where each sequence goes (no Ray, no tensors).

Global sample index: sample `j` of prompt `p` is `p * samples_per_prompt + j`. Every strategy
uses it, so the same rollout lands in the same order whatever moved it, and `Sample.index` /
`batch.indices` name each sequence on the trainer.

A sample is one trajectory, and most trajectories train as one sequence. One that trains as
several (an `env=agent` trajectory with a second conversation, or history its agent rewrote) keeps
its own index for the first; its k-th further sequence is `index + k * EXTRA_SEQUENCE_STRIDE`
(`extra_sequence_index`). The engine that made the trajectory numbers them without asking
anyone, every index stays unique and deterministic (exact resume, the same order under every
strategy), and `trajectory_of` / `group_of` give back the trajectory and its prompt group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhf_orch.transfer.micro_batches import (
    near_equal_ranges,
    plan_token_budget_micro_batches,
    shard_for_ranks,
    split_by_count,
)


# Above every index a rollout's prompts can reach (dynamic sampling's rounds included), and small
# enough that index + k x stride stays an int64 for any call budget.
EXTRA_SEQUENCE_STRIDE = 1 << 40


def extra_sequence_index(trajectory: int, k: int) -> int:
    """The index of trajectory `trajectory`'s k-th further sequence (k >= 1)."""
    if k < 1 or not 0 <= trajectory < EXTRA_SEQUENCE_STRIDE:
        raise ValueError(f"no extra sequence {k} of trajectory {trajectory}")
    return trajectory + k * EXTRA_SEQUENCE_STRIDE


def trajectory_of(index: int) -> int:
    """The trajectory (its first sequence's index) that sequence `index` belongs to."""
    return index % EXTRA_SEQUENCE_STRIDE


def is_extra_sequence(index: int) -> bool:
    return index >= EXTRA_SEQUENCE_STRIDE


def group_of(index: int, samples_per_prompt: int) -> int:
    """The prompt whose group sequence `index` belongs to (group-relative estimators)."""
    return trajectory_of(index) // samples_per_prompt


def check_trajectories_divide(indices: Sequence[int], num_ranks: int) -> None:
    """The rule every strategy follows: the trajectories (not their further sequences) divide
    evenly over the data-parallel ranks (`shard_for_ranks` raises the error naming the keys)."""
    shard_for_ranks(sum(not is_extra_sequence(i) for i in indices), num_ranks)


def group_ids(indices: Sequence[int], samples_per_prompt: int) -> list[int]:
    return [group_of(int(i), samples_per_prompt) for i in indices]


@dataclass(frozen=True)
class CompletionRequest:
    """Ask an engine for `count` samples of prompt `prompt_index`, numbered from `first_sample`."""

    prompt_index: int
    first_sample: int
    count: int

    def indices(self, samples_per_prompt: int) -> range:
        start = self.prompt_index * samples_per_prompt + self.first_sample
        return range(start, start + self.count)


@dataclass(frozen=True)
class MicroBatchWork:
    """One count-based micro-batch: which shard/slot it fills and the requests that produce it."""

    shard: int
    slot: int
    num_slots: int  # micro-batches of this shard
    indices: range  # global sample indices, contiguous
    requests: tuple[CompletionRequest, ...]


def requests_for_indices(indices: range, samples_per_prompt: int) -> tuple[CompletionRequest, ...]:
    """The fewest requests covering exactly `indices` (a prompt cut by a micro-batch boundary is
    asked twice, once per side, for the samples on that side)."""
    requests = []
    i = indices.start
    while i < indices.stop:
        prompt, first = divmod(i, samples_per_prompt)
        count = min(samples_per_prompt - first, indices.stop - i)
        requests.append(CompletionRequest(prompt, first, count))
        i += count
    return tuple(requests)


def plan_count_micro_batches(
    num_prompts: int, samples_per_prompt: int, num_shards: int, micro_batch_size: int
) -> list[MicroBatchWork]:
    """Contiguous equal shards (`shard_for_ranks`), each cut into `micro_batch_size` sequences."""
    works = []
    for shard, rows in enumerate(shard_for_ranks(num_prompts * samples_per_prompt, num_shards)):
        parts = split_by_count(len(rows), micro_batch_size)
        for slot, part in enumerate(parts):
            indices = range(rows.start + part.start, rows.start + part.stop)
            works.append(
                MicroBatchWork(shard, slot, len(parts), indices, requests_for_indices(indices, samples_per_prompt))
            )
    return works


def interleave_over_engines(works: Sequence[MicroBatchWork], num_engines: int) -> list[list[MicroBatchWork]]:
    """Round-robin by slot across shards, so every trainer rank gets its first micro-batches early."""
    if num_engines < 1:
        raise ValueError(f"need at least one engine, got {num_engines}")
    ordered = sorted(works, key=lambda w: (w.slot, w.shard))
    return [list(ordered[e::num_engines]) for e in range(num_engines)]


def prompt_chunks(num_prompts: int, num_engines: int) -> list[range]:
    """Contiguous prompt ranges, one per engine, sizes differing by at most one."""
    if num_engines < 1:
        raise ValueError(f"need at least one engine, got {num_engines}")
    return near_equal_ranges(num_prompts, num_engines)


def whole_prompt_requests(prompts: Sequence[int], samples_per_prompt: int) -> list[CompletionRequest]:
    return [CompletionRequest(p, 0, samples_per_prompt) for p in prompts]


def plan_packed(
    indices: Sequence[int],
    seq_lens: Sequence[int],
    token_budget: int,
    num_ranks: int,
    held_by_engine: Sequence[Sequence[int]] | None = None,
    *,
    steps: int,
) -> list[list[list[int]]]:
    """Token-budget micro-batches balanced over ranks, in GLOBAL sample indices; with `steps`,
    each optimizer step's sequences packed on their own (`plan_token_budget_micro_batches`).

    `plan[rank][micro_batch]` lists global indices (ascending); empty micro-batches are explicit
    (see `plan_token_budget_micro_batches`). Also refuses a rollout that does not divide over ranks
    -- the same rule every strategy follows, so `transfer=` never changes which configs run.
    With `held_by_engine` (per engine, the indices it holds), micro-batches stay within one
    engine's sequences where that costs no extra micro-batch: the trainer then uses its part of
    that engine's piece as it is, without a copy.
    """
    if len(indices) != len(seq_lens):
        raise ValueError(f"{len(indices)} indices but {len(seq_lens)} lengths")
    check_trajectories_divide(indices, num_ranks)
    order = sorted(range(len(indices)), key=lambda k: indices[k])
    ordered_idx = [indices[k] for k in order]
    ordered_len = [seq_lens[k] for k in order]
    groups = None
    if held_by_engine is not None:
        owner = {i: e for e, held in enumerate(held_by_engine) for i in held}
        groups = [owner.get(i, -1) for i in ordered_idx]
    plan = plan_token_budget_micro_batches(ordered_len, token_budget, num_ranks, groups, steps=steps)
    return [[[ordered_idx[k] for k in mb] for mb in rank] for rank in plan]


def pieces_per_engine(
    plan: list[list[list[int]]], held_by_engine: Sequence[Sequence[int]]
) -> list[list[list[list[int]]]]:
    """`cut[engine][rank][micro_batch]` = the planned indices of that micro-batch that `engine` holds.

    The trainer assembles a micro-batch by concatenating its parts engine after engine, so the plan
    must list each micro-batch's members in that order (ascending when engines hold contiguous
    index ranges, as one rollout round gives; `PackedTransfer` sorts by (engine, index)).
    """
    owner = {i: e for e, held in enumerate(held_by_engine) for i in held}
    cut = [[[[] for _ in rank] for rank in plan] for _ in held_by_engine]
    for rank, micro_batches in enumerate(plan):
        for k, mb in enumerate(micro_batches):
            for i in mb:
                if i not in owner:
                    raise ValueError(f"sample {i} is planned but no engine holds it")
                cut[owner[i]][rank][k].append(i)
    return cut


def optimizer_steps(num_sequences: int, train_batch_size: int) -> int:
    """Optimizer steps per epoch over a rollout of `num_sequences` (`plan_optimizer_steps`' count;
    `train_batch_size` 0: one)."""
    return max(1, num_sequences // train_batch_size) if train_batch_size > 0 else 1


def derive_token_budget(token_budget: int, micro_batch_size: int, max_seq_len: int) -> int:
    """`transfer.token_budget`, or `micro_batch_size x max_seq_len` when it is 0 ("derive")."""
    if token_budget < 0:
        raise ValueError(f"transfer.token_budget={token_budget} must be >= 0 (0 derives it)")
    return token_budget or micro_batch_size * max_seq_len
