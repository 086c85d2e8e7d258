"""Micro-batch planners: pure functions on sequence counts and lengths, no tensors.

`split_by_count` / `near_equal_ranges` / `shard_for_ranks` cut by count; `plan_token_budget_micro_batches`
packs sequences into micro-batches of at most a token budget, balanced over data-parallel ranks
(and keeping a prompt's samples together where it can).
"""

from __future__ import annotations

import heapq
from typing import Sequence


def split_by_count(n_seqs: int, micro_batch_size: int) -> list[range]:
    """Consecutive ranges of `micro_batch_size` sequences; the last one may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"algo.micro_batch_size={micro_batch_size} must be >= 1")
    if n_seqs < 0:
        raise ValueError(f"n_seqs={n_seqs} must be >= 0")
    return [range(s, min(s + micro_batch_size, n_seqs)) for s in range(0, n_seqs, micro_batch_size)]


def near_equal_ranges(n: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering 0..n-1, sizes differing by at most one (larger first)."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def shard_for_ranks(n: int, num_ranks: int) -> list[range]:
    """Contiguous, equal shards of `n` sequences, one per data-parallel rank.

    Contiguous (not strided) so the samples of one prompt stay on one rank and a shard of a
    `PackedBatch` is a view (`PackedBatch.split`). Equal, because data-parallel ranks take the
    same number of optimizer steps over the same number of sequences.
    """
    if num_ranks < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {num_ranks}")
    if n % num_ranks:
        raise ValueError(
            f"{n} sequences per step (algo.rollout_batch_size x algo.samples_per_prompt) do not "
            f"divide evenly over {num_ranks} data-parallel ranks (placement.actor_ranks / "
            "placement.critic_ranks); make the product a multiple of the data-parallel size"
        )
    per_rank = n // num_ranks
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(num_ranks)]


def plan_token_budget_micro_batches(
    lengths: Sequence[int], token_budget: int, num_ranks: int, groups: Sequence[int] | None = None, steps: int = 1
) -> list[list[list[int]]]:
    """Plan token-budgeted micro-batches: `plan[rank][micro_batch] = [sequence indices]`.

    Guarantees:
    * every index in `range(len(lengths))` appears exactly once in the whole plan;
    * every micro-batch holds at most `token_budget` tokens (sum of its sequences' lengths);
    * every rank gets the SAME number of micro-batches -- DeepSpeed ranks all-reduce gradients in
      lockstep, so a rank with fewer backward passes would hang the others;
    * tokens per rank are balanced.

    Method (deterministic; ties broken by index, then rank id):
    1. Ranks: greedy longest-processing-time -- sequences, longest first, each onto the rank with
       the fewest tokens so far (LPT: within 4/3 of the optimal makespan).
    2. Per rank: first-fit-decreasing bin packing into micro-batches of `token_budget`.
    3. Equalise: a rank with fewer micro-batches than the most has splits its micro-batch with
       the most sequences in two (halves balanced by tokens) until it matches. Only when a rank
       has fewer sequences than the target count does it get EXPLICIT EMPTY micro-batches `[]`
       at the end of its list: the caller must still run a zero-loss forward/backward for them
       (`ppo_math` reductions over no tokens are 0) so the collectives line up.
    Within a micro-batch, indices are ascending.

    `steps` (the rollout's optimizer steps per epoch): each rank's sequences are first cut, in index
    order, into `steps` near-equal runs by count -- one per optimizer step, as veRL cuts mini-batches
    before packing them -- and steps 2-3 pack and equalise each run on its own, to the same count
    for every run of every rank. The trainers' step plan (`plan_optimizer_steps`: `steps` near-equal
    runs of consecutive micro-batches) then finds each step's micro-batches exactly, whatever the
    budget: a budget larger than a step's tokens can no longer merge steps.

    `groups` (optional, per sequence: e.g. the engine holding it) keeps micro-batches within one
    group: step 2 packs each group of a rank on its own, then dissolves the lightest micro-batches
    holding at most half the budget into the others' free room (those become mixed) while the
    rank has more micro-batches than its tokens need. A rank thus gets at most one micro-batch
    more per further group than step 2 over the whole rank gives, each over half full (should it
    get more, it is packed as without groups). Micro-batches are listed group by group in turns.
    Step 1 ignores groups, so the balance over ranks is the same either way; a micro-batch within
    one group reaches a trainer as a view of that group's piece (no copy).
    """
    if token_budget < 1:
        raise ValueError(
            f"transfer.token_budget={token_budget} must be >= 1 when planning micro-batches "
            "(0 means 'derive': resolve it to algo.micro_batch_size x max sequence length first)"
        )
    if num_ranks < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {num_ranks}")
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sequence {i} has length {length}; every sequence has >= 1 token")
    too_long = [(i, length) for i, length in enumerate(lengths) if length > token_budget]
    if too_long:
        i, length = max(too_long, key=lambda item: item[1])
        raise ValueError(
            f"{len(too_long)} sequence(s) exceed transfer.token_budget={token_budget}, the longest "
            f"is sequence {i} with {length} tokens; set transfer.token_budget >= {length} (or "
            "shorten data.prompt_max_len + data.response_max_len)"
        )

    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    members = _balance_over_ranks(longest_first, lengths, num_ranks)
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"{len(groups)} groups for {len(lengths)} sequences")
    if steps < 1:
        raise ValueError(f"optimizer steps must be >= 1, got {steps}")

    def pack(run: list[int]) -> list[list[int]]:
        if not run:
            return []
        return (
            _first_fit_decreasing(run, lengths, token_budget)
            if groups is None
            else _grouped_or_plain(run, lengths, token_budget, groups)
        )

    ordered = [sorted(m) for m in members]
    runs = [[[m[k] for k in part] for part in near_equal_ranges(len(m), steps)] for m in ordered]
    per_run = [[pack(run) for run in rank_runs] for rank_runs in runs]
    target = max((len(mbs) for rank_runs in per_run for mbs in rank_runs), default=0)
    return [[mb for mbs in rank_runs for mb in _equalise(mbs, lengths, target)] for rank_runs in per_run]


def _balance_over_ranks(order: list[int], lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    # Heap of (tokens so far, sequences so far, rank): least-loaded rank on top.
    heap = [(0, 0, rank) for rank in range(num_ranks)]
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, count, rank = heapq.heappop(heap)
        members[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, rank))
    return members


def _first_fit_decreasing(members: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(members, key=lambda i: (-lengths[i], i)):
        length = lengths[i]
        for slot, free in enumerate(room):  # first fit (a plain loop: this is the planner's hot spot)
            if length <= free:
                break
        else:
            bins.append([])
            room.append(budget)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= length
    return [sorted(b) for b in bins]


def _grouped_first_fit_decreasing(
    members: list[int], lengths: Sequence[int], budget: int, groups: Sequence[int]
) -> list[list[int]]:
    """First-fit-decreasing per group; then the lightest micro-batches holding at most half the
    budget are dissolved into the others' free room while the rank has more micro-batches than
    its tokens need (see the planner)."""
    by_group: dict[int, list[int]] = {}
    for i in members:
        by_group.setdefault(groups[i], []).append(i)
    # (turn within its group, group, members): listing order, and what each bin holds.
    bins = [
        (turn, group, b)
        for group in sorted(by_group)
        for turn, b in enumerate(_first_fit_decreasing(by_group[group], lengths, budget))
    ]
    loads = [sum(lengths[i] for i in b) for _, _, b in bins]
    fewest = -(-sum(loads) // budget)  # no packing has fewer micro-batches
    while len(bins) > fewest:
        for light in sorted(range(len(bins)), key=lambda b: (loads[b], b)):
            if 2 * loads[light] > budget:
                return _in_turns(bins)  # the rest are over half full: kept apart, one group each
            placed = _best_fit(bins[light][2], {b: budget - loads[b] for b in range(len(bins)) if b != light}, lengths)
            if placed is None:
                continue
            for b, extra in placed.items():
                turn, group, held = bins[b]
                bins[b] = (turn, group, sorted(held + extra))
                loads[b] += sum(lengths[i] for i in extra)
            del bins[light], loads[light]
            break
        else:
            break  # nothing dissolves into the others' room
    return _in_turns(bins)


def _grouped_or_plain(
    members: list[int], lengths: Sequence[int], budget: int, groups: Sequence[int]
) -> list[list[int]]:
    """Grouped micro-batches, unless they outnumber first-fit-decreasing over the whole rank by
    more than one per further group (groups of complementary lengths could): then those."""
    grouped = _grouped_first_fit_decreasing(members, lengths, budget, groups)
    extra = len({groups[i] for i in members}) - 1
    if len(grouped) <= -(-sum(lengths[i] for i in members) // budget) + extra:
        return grouped  # within the bound whatever first-fit-decreasing gives (it gives at least that)
    plain = _first_fit_decreasing(members, lengths, budget)
    return grouped if len(grouped) <= len(plain) + extra else plain


def _best_fit(members: list[int], room: dict[int, int], lengths: Sequence[int]) -> dict[int, list[int]] | None:
    """Longest first, each into the fullest bin it fits (filling one bin first); None if one fits nowhere."""
    placed: dict[int, list[int]] = {}
    room = dict(room)
    for i in sorted(members, key=lambda i: (-lengths[i], i)):
        fits = [b for b, free in room.items() if lengths[i] <= free]
        if not fits:
            return None
        best = min(fits, key=lambda b: (room[b], b))
        room[best] -= lengths[i]
        placed.setdefault(best, []).append(i)
    return placed


def _in_turns(bins: list[tuple[int, int, list[int]]]) -> list[list[int]]:
    """Micro-batches group by group in turns (each group's first, then each group's second, ...)."""
    return [b for _, _, b in sorted(bins, key=lambda t: (t[0], t[1]))]


def _equalise(micro_batches: list[list[int]], lengths: Sequence[int], target: int) -> list[list[int]]:
    result = [list(mb) for mb in micro_batches]
    while len(result) < target:
        splittable = [b for b, mb in enumerate(result) if len(mb) >= 2]
        if not splittable:
            result.append([])  # explicit empty micro-batch, see the planner's docstring
            continue
        b = max(splittable, key=lambda b: (len(result[b]), sum(lengths[i] for i in result[b]), -b))
        result[b : b + 1] = _halve_by_tokens(result[b], lengths)
    return result


def _halve_by_tokens(indices: list[int], lengths: Sequence[int]) -> list[list[int]]:
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        lighter = 0 if loads[0] <= loads[1] else 1
        halves[lighter].append(i)
        loads[lighter] += lengths[i]
    return [sorted(h) for h in halves]
