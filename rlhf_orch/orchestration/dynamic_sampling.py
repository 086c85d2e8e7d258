"""DAPO's dynamic sampling: the rounds of a step's rollout until its batch holds only informative
prompt groups. Orchestration's business (how many rounds, which prompts, which groups a step trains
on); the transfer only generates a round and holds it (`PackedTransfer.generate_round`,
`held_rollout`), the algorithm says which groups carry signal (`GroupFilter.keep`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlhf_orch.transfer.base import EngineShare, HeldRollout, RolloutRequest, RolloutTransfer, Route
from rlhf_orch.transfer.plan import group_ids, group_of
from rlhf_orch.transfer.rollout_meta import RolloutMeta


@dataclass
class GroupFilter:
    """Dynamic sampling (DAPO): keep only informative prompt groups, draw more prompts until full.

    `keep(scores [B], group_ids [B]) -> bool [B]` marks the samples to keep (whole groups);
    `more_prompts(n)` draws n further prompts; at most `max_rounds` rollout rounds per step.
    """

    keep: Callable[[Any, Any], Any]
    more_prompts: Callable[[int], list[Any]]
    max_rounds: int


def generate(
    transfer: RolloutTransfer, request: RolloutRequest, route: Route, group_filter: GroupFilter | None
) -> HeldRollout:
    """A step's rollout generated and held: in one round, or with `group_filter` in as many as
    dynamic sampling takes (packed transfer only: validated)."""
    if group_filter is None:
        return transfer.generate(request, route)
    t = time.perf_counter()
    shares: list[list[EngineShare]] = [[] for _ in route.engines]
    held = transfer.generate_round(request, route, range(len(request.prompts)), shares)
    held, rounds, dropped = fill_with_informative_groups(transfer, request, route, held, shares, group_filter)
    return transfer.held_rollout(request, held, shares, time.perf_counter() - t, rounds=rounds, dropped=dropped)


def fill_with_informative_groups(
    transfer: Any,
    request: RolloutRequest,
    route: Route,
    held: list[list[RolloutMeta]],
    shares: list[list[EngineShare]],
    f: GroupFilter,
) -> tuple[list[list[RolloutMeta]], int, int]:
    """DAPO's dynamic sampling: drop groups whose samples all scored the same, generate more
    prompts (the same number again) until `len(request.prompts)` informative groups are held or
    `max_rounds` rounds ran; then keep exactly that many groups -- topping up with dropped
    groups (zero advantage) if the rounds ran out -- so every step trains on the same shape.
    Engines keep only what is planned (`cut_for_ranks` releases the rest). An engine replaced
    in a later round took its earlier rounds' samples along: `shares` says so, and the caller
    decides (`EngineFleet.redraw_lost_shares`). Returns (per engine the kept metadata, rounds,
    groups dropped)."""
    spp = request.samples_per_prompt
    need = len(request.prompts)
    rounds = 1

    def informative() -> list[int]:
        # (a masked trajectory trains nothing and counts in no group's statistics: nor here)
        meta = RolloutMeta.merge([m for parts in held for m in parts]).trajectories_only()
        meta = meta.select([r for r, masked in enumerate(meta.masked) if not masked])
        keep = f.keep(torch.tensor(meta.rewards), torch.tensor(group_ids(meta.indices, spp))).tolist()
        return sorted({group_of(i, spp) for i, k in zip(meta.indices, keep) if k})

    groups = informative()
    while len(groups) < need and rounds < f.max_rounds:
        start = len(request.prompts)
        more = f.more_prompts(need)
        request.prompts.extend(more)
        request.prompt_ids.extend(list(p.prompt_ids) for p in more)
        for e, parts in enumerate(transfer.generate_round(request, route, range(start, start + len(more)), shares)):
            held[e].extend(parts)
        rounds += 1
        groups = informative()
    generated = len(request.prompts)
    chosen = set(groups[:need])
    if len(chosen) < need:  # rounds ran out: fill with uninformative groups (advantage 0)
        chosen |= set(sorted(set(range(generated)) - chosen)[: need - len(chosen)])
    kept = [[m.where(lambda i: group_of(i, spp) in chosen) for m in parts] for parts in held]
    for engine_shares in shares:  # (a share left with no kept prompt holds nothing a replacement could lose)
        engine_shares[:] = [
            s
            for s in (dataclasses.replace(s, prompts=[p for p in s.prompts if p in chosen]) for s in engine_shares)
            if s.prompts
        ]
    return kept, rounds, generated - len(set(groups[:need]))
