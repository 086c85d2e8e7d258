"""Padding-free, token-budget micro-batches balanced over ranks, engine to trainer without the driver.

1. Engines generate and score, packing each sequence into flat per-engine buffers as it finishes
   (`PackedBuffer`), and return only indices/lengths/rewards.
2. The driver plans micro-batches of at most `token_budget` tokens, balanced over data-parallel
   ranks, each within one engine's sequences where that costs no extra micro-batch (`plan_packed`,
   pure, on lengths and holders only).
3. Each engine gathers one packed piece per rank from its buffers (`cut_for_ranks`, one object
   per rank); each rank fetches its pieces from the engines and cuts its planned micro-batches
   (`assemble_packed`): views of a piece, a concatenation only for a micro-batch spanning engines.
   One flat token buffer + `cu_seqlens` + per-token fields: no padding ever exists on the wire,
   and the trainers' forward consumes the packed micro-batches as they are.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import ray

from rlhf_orch.transfer.base import (
    Delivery,
    EngineShare,
    HeldRollout,
    MicroBatch,
    RolloutRequest,
    RolloutTransfer,
    Route,
)
from rlhf_orch.transfer.batch import PackedBatch, Sample
from rlhf_orch.transfer.rollout_meta import RolloutMeta
from rlhf_orch.transfer.inbox import assemble_packed
from rlhf_orch.transfer.plan import (
    derive_token_budget,
    optimizer_steps,
    group_of,
    pieces_per_engine,
    plan_packed,
    prompt_chunks,
    whole_prompt_requests,
)


class PackedTransfer(RolloutTransfer):
    def __init__(self, token_budget: int):
        if token_budget < 0:
            raise ValueError(f"transfer.token_budget={token_budget} must be >= 0 (0 derives it)")
        self.token_budget = token_budget

    def budget(self, micro_batch_size: int, max_seq_len: int) -> int:
        return derive_token_budget(self.token_budget, micro_batch_size, max_seq_len)

    def layout(
        self,
        samples: Sequence[Sample],
        num_shards: int,
        micro_batch_size: int,
        pad_id: int,
        held_by_engine: Sequence[Sequence[int]] | None = None,
        train_batch_size: int = RolloutRequest.train_batch_size,
    ) -> list[list[MicroBatch]]:
        """`held_by_engine` (per engine, the indices it holds): the micro-batches `hand_over`
        plans for a rollout held that way; without it, as if one engine held everything."""
        ordered = sorted(samples, key=lambda s: s.index)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in ordered]
        budget = self.budget(micro_batch_size, max(lengths))
        steps = optimizer_steps(len(lengths), train_batch_size)
        plan = _engine_ordered(
            plan_packed([s.index for s in ordered], lengths, budget, num_shards, held_by_engine, steps=steps),
            held_by_engine,
        )
        whole = PackedBatch.from_samples(ordered)
        position = {s.index: k for k, s in enumerate(ordered)}
        shards = []
        for rank_plan in plan:
            members = [position[i] for mb in rank_plan for i in mb]  # micro-batch order, as engines cut
            piece = whole.select(members) if members else None
            shards.append(assemble_packed([piece], rank_plan, pad_id))
        return shards

    def generate(self, request: RolloutRequest, route: Route) -> HeldRollout:
        t = time.perf_counter()
        shares: list[list[EngineShare]] = [[] for _ in route.engines]
        held = self.generate_round(request, route, range(len(request.prompts)), shares)
        return self.held_rollout(request, held, shares, time.perf_counter() - t, rounds=1, dropped=None)

    def held_rollout(
        self,
        request: RolloutRequest,
        held: list[list[RolloutMeta]],
        shares: list[list[EngineShare]],
        generate_s: float,
        *,
        rounds: int,
        dropped: int | None,
    ) -> HeldRollout:
        """The rollout the engines hold after its rounds (`held`: per engine, the metadata of what
        it keeps; `rounds`, `dropped`: DAPO's dynamic sampling, `rlhf_orch.orchestration.dynamic_sampling`)."""
        timings = {"generate": generate_s, "reward": 0.0}  # scored on the engines, inside generation
        return HeldRollout(
            meta=RolloutMeta.merge([m for parts in held for m in parts]),
            held=[[i for m in parts for i in m.indices] for parts in held],  # per engine: what it holds
            request=request,
            shares=shares,
            num_shards=request.num_shards,
            micro_batch_size=request.micro_batch_size,
            pad_id=request.pad_id,
            max_seq_len=request.max_seq_len,
            timings=timings,
            dropped_groups=dropped,
            rounds=rounds,
            slot=request.slot,
            train_batch_size=request.train_batch_size,
        )

    def hand_over(self, held: HeldRollout, route: Route) -> Delivery:
        timings = dict(held.timings)
        t = time.perf_counter()
        meta = held.meta
        waited = held.waited()  # a held rollout waits for the trainers by design: not transfer
        timings["metadata_to_driver"] = time.time() - meta.generated_at - waited
        budget = self.budget(held.micro_batch_size, held.max_seq_len)
        steps = optimizer_steps(len(meta.seq_lens), held.train_batch_size)
        # Micro-batches within one engine's sequences where that costs nothing (the trainer then
        # uses its part of that engine's piece as it is).
        plan = _engine_ordered(
            plan_packed(meta.indices, meta.seq_lens, budget, held.num_shards, held.held, steps=steps), held.held
        )
        cut = pieces_per_engine(plan, held.held)
        timings["plan"] = time.perf_counter() - t
        pieces = []  # pieces[engine][rank]: object refs, owned here, data in the engine's store
        for engine, members in zip(route.engines, cut):  # (a replaced engine holds its re-issued share)
            # Kept on the engines until every trainer staged its part: an engine lost meanwhile
            # (pipeline=async) has its share drawn again and the hand-over planned and cut anew.
            refs = engine.cut_for_ranks.options(num_returns=held.num_shards).remote(members, held.slot, release=False)
            pieces.append([refs] if held.num_shards == 1 else list(refs))
        calls = self._stage_all(
            route, lambda shard, actor: actor.stage_pieces.remote(shard, plan[shard], [p[shard] for p in pieces])
        )
        received = route.get(calls, "handing experience to the trainers")
        release_held(route.engines, held.slot, route.timeout_s)
        self._timed(timings, "hand_over", t)
        # From "generation finished" on the engines (their clock) to "every trainer holds its data".
        timings["transfer"] = timings["transfer_after_generate"] = time.time() - meta.generated_at - waited
        first_of_shard = [sum(len(a) for a in route.consumers[:s]) for s in range(len(route.consumers))]
        return Delivery(
            meta=meta,
            wire_bytes=sum(received[k] for k in first_of_shard),
            wire_tokens=sum(meta.seq_lens),
            timings=timings,
            dropped_groups=held.dropped_groups,
            rounds=held.rounds,
        )

    def export_held(self, held: HeldRollout, route: Route) -> HeldRollout:
        samples = route.get(
            [engine.held_samples.remote(held.slot) for engine in route.engines],
            "reading the held rollout",
            engine_call=True,
        )
        return held.for_checkpoint(samples)

    def import_held(self, held: HeldRollout, route: Route) -> HeldRollout:
        route.get(
            [engine.hold_samples.remote(s, held.slot) for engine, s in zip(route.engines, held.held)],
            "restoring the held rollout",
            engine_call=True,
        )
        return dataclasses.replace(
            held,
            held=[[s.index for s in samples] for samples in held.held],
            samples=held.held,
            shares=[[EngineShare(engine, [])] for engine in route.engines],  # (held again from `samples` if lost)
        )

    def redraw(self, held: HeldRollout, route: Route, engines: Sequence[int]) -> int:
        """Make the shares of `engines` whose process was replaced since (`EngineShare.engine` is not
        the route's) again on the current processes: from the request's prompts (drawn anew: not the
        samples that were lost), or a restored rollout's samples held again as they were. A share the
        current process made itself stays (DAPO: a later round's). The lost shares' rows of
        `held.meta` -- every sequence of their prompts', a trajectory's further ones included -- are
        replaced by the new ones, and `held.held` follows. Returns the samples made or held again."""
        if held.samples is not None:  # (one share per engine: the checkpoint's samples)
            route.on_engines(
                lambda e, engine: engine.hold_samples.remote(held.samples[e], held.slot),
                engines,
                "holding a lost engine's samples again",
            )
            for e in engines:
                held.shares[e] = [EngineShare(route.engines[e], [])]
            return sum(len(held.samples[e]) for e in engines)
        request = held.request
        spp = request.samples_per_prompt
        before = {e: route.engines[e] for e in engines}
        lost = {
            e: sorted({p for share in held.shares[e] if share.engine is not before[e] for p in share.prompts})
            for e in engines
        }
        made = route.on_engines(
            lambda e, engine: engine.produce_and_hold.remote(
                whole_prompt_requests(lost[e], spp), request.job(lost[e], request.scorer), held.slot
            ),
            [e for e in engines if lost[e]],
            "drawing a lost engine's share again",
        )
        gone = {p for prompts in lost.values() for p in prompts}
        held.meta = RolloutMeta.merge([held.meta.where(lambda i: group_of(i, spp) not in gone), *made.values()])
        for e in engines:
            # (one that died during this redraw was replaced by `on_engines`: the shares it kept are
            # now lost too -- their engine is not the route's -- and the caller looks again)
            kept = [share for share in held.shares[e] if share.engine is before[e]]
            held.shares[e] = kept + ([EngineShare(route.engines[e], lost[e])] if lost[e] else [])
            mine = {p for share in held.shares[e] for p in share.prompts}
            held.held[e] = [i for i in held.meta.indices if group_of(i, spp) in mine]
        return sum(len(m.indices) for m in made.values())

    @staticmethod
    def _generate(request: RolloutRequest, route: Route, prompts: range) -> list[list[RolloutMeta]]:
        """Prompts `prompts` (indices into request.prompts) over the engines; per engine, its meta."""
        chunks = {
            e: range(prompts.start + c.start, prompts.start + c.stop)
            for e, c in enumerate(prompt_chunks(len(prompts), len(route.engines)))
            if len(c)
        }

        def submit(e, engine):
            chunk = chunks[e]
            return engine.produce_and_hold.remote(
                whole_prompt_requests(chunk, request.samples_per_prompt),
                request.job(chunk, request.scorer),
                request.slot,
            )

        metas = route.on_engines(submit, list(chunks), "generating")
        return [[metas[e]] if e in metas else [] for e in range(len(route.engines))]

    @classmethod
    def generate_round(
        cls, request: RolloutRequest, route: Route, prompts: range, shares: list[list[EngineShare]]
    ) -> list[list[RolloutMeta]]:
        """Prompts `prompts` (indices into request.prompts) generated, scored and held on the
        engines; per engine, their metadata. Notes in `shares` which engine process made which
        prompts' samples (the process that answered: a replacement, when one died on the way, holds
        its re-issued share)."""
        made = cls._generate(request, route, prompts)
        spp = request.samples_per_prompt
        for e, parts in enumerate(made):
            if parts:
                shares[e].append(
                    EngineShare(route.engines[e], sorted({group_of(i, spp) for m in parts for i in m.indices}))
                )
        return made


def release_held(engines: Sequence[Any], slot: int, timeout_s: float) -> None:
    """Every engine lets go of `slot` (its rollout is on the trainers). One lost meanwhile held
    nothing the run still needs: its failure is found by the next call that needs it."""
    refs = [engine.release_held.remote(slot) for engine in engines]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass


def _engine_ordered(
    plan: list[list[list[int]]], held_by_engine: Sequence[Sequence[int]] | None
) -> list[list[list[int]]]:
    """Each micro-batch's members engine after engine (ascending within an engine): the order the
    trainer concatenates the engines' pieces in, for a micro-batch that spans engines."""
    if held_by_engine is None:
        return plan
    owner = {i: e for e, indices in enumerate(held_by_engine) for i in indices}
    return [[sorted(mb, key=lambda i: (owner[i], i)) for mb in rank] for rank in plan]
