"""Padding-free, token-budget micro-batches balanced over ranks, engine to trainer without the driver.

1. Engines generate and score, keep their samples, and return only indices/lengths/rewards.
2. The driver plans micro-batches of at most `token_budget` tokens, balanced over data-parallel
   ranks (`plan_packed`, pure, on lengths only).
3. Each engine puts one packed piece per rank (`cut_for_ranks`, one object per rank); each rank
   fetches its pieces from the engines and cuts its planned micro-batches (`assemble_packed`).
   One flat token buffer + `cu_seqlens` + per-token fields: no padding ever exists on the wire,
   and the trainers' forward consumes the packed micro-batches as they are.
"""

from __future__ import annotations

import time
from typing import Sequence

from rlhf_orch.transfer.base import Delivery, MicroBatch, RolloutRequest, RolloutTransfer, Route, merge_meta
from rlhf_orch.transfer.batch import PackedBatch, Sample
from rlhf_orch.transfer.inbox import assemble_packed
from rlhf_orch.transfer.plan import derive_token_budget, pieces_per_engine, plan_packed, prompt_chunks, whole_prompt_requests


class PackedTransfer(RolloutTransfer):
    def budget(self, micro_batch_size: int, max_seq_len: int) -> int:
        return derive_token_budget(self.token_budget, micro_batch_size, max_seq_len)

    def layout(self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int) -> list[list[MicroBatch]]:
        ordered = sorted(samples, key=lambda s: s.index)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in ordered]
        budget = self.budget(micro_batch_size, max(lengths))
        plan = plan_packed([s.index for s in ordered], lengths, budget, num_shards)
        whole = PackedBatch.from_samples(ordered)
        position = {s.index: k for k, s in enumerate(ordered)}
        shards = []
        for rank_plan in plan:
            members = [position[i] for mb in rank_plan for i in mb]  # micro-batch order, as engines cut
            piece = whole.select(members) if members else None
            shards.append(assemble_packed([piece], rank_plan, pad_id))
        return shards

    def deliver(self, request: RolloutRequest, route: Route) -> Delivery:
        timings: dict[str, float] = {}
        t = time.perf_counter()
        chunks = [c for c in prompt_chunks(len(request.prompts), len(route.engines))]
        engines = [e for e, c in zip(route.engines, chunks) if len(c)]
        calls = [
            engine.produce_and_hold.remote(whole_prompt_requests(chunk, request.samples_per_prompt), request.job(chunk, request.scorer))
            for engine, chunk in zip(route.engines, chunks)
            if len(chunk)
        ]
        held = route.get(calls, "generating", engine_call=True)
        t = self._timed(timings, "generate", t)
        timings["reward"] = 0.0  # scored on the engines, inside generation

        meta = merge_meta(held)
        timings["metadata_to_driver"] = time.time() - meta.generated_at
        t_plan = time.perf_counter()
        budget = self.budget(request.micro_batch_size, request.max_seq_len)
        plan = plan_packed(meta.indices, meta.seq_lens, budget, request.num_shards)
        cut = pieces_per_engine(plan, [m.indices for m in held])
        timings["plan"] = time.perf_counter() - t_plan
        pieces = []  # pieces[engine][rank]: object refs, owned here, data in the engine's store
        for engine, members in zip(engines, cut):
            refs = engine.cut_for_ranks.options(num_returns=request.num_shards).remote(members)
            pieces.append([refs] if request.num_shards == 1 else list(refs))
        calls = self._stage_all(
            route, lambda shard, actor: actor.stage_pieces.remote(shard, plan[shard], [p[shard] for p in pieces])
        )
        received = route.get(calls, "handing experience to the trainers")
        self._timed(timings, "hand_over", t)
        # From "generation finished" on the engines (their clock) to "every trainer holds its data".
        timings["transfer"] = timings["transfer_after_generate"] = time.time() - meta.generated_at
        first_of_shard = [sum(len(a) for a in route.consumers[:s]) for s in range(len(route.consumers))]
        return Delivery(
            meta=meta,
            wire_bytes=sum(received[k] for k in first_of_shard),
            wire_tokens=sum(meta.seq_lens),
            timings=timings,
        )
