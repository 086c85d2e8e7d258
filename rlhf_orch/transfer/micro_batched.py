"""Streaming, padding per micro-batch only, engine to trainer without the driver.

Engines get count-based micro-batches to fill (`plan_count_micro_batches`), run all their requests
in one continuous batch, and `ray.put` each micro-batch -- padded to its own longest sequence --
the moment its last sequence finishes, yielding a small ticket. The driver forwards each ticket's
object ref to that shard's trainers, which fetch it from the engine's object store while the
engines keep generating. At most `max_in_flight` micro-batches are handed out and not yet staged
(Ray generator back-pressure on the engines plus a wait on the oldest stage calls here).
"""

from __future__ import annotations

import time
from typing import Sequence

import ray

from rlhf_orch.transfer.base import Delivery, MicroBatch, RolloutRequest, RolloutTransfer, Route, count_micro_batches, merge_meta
from rlhf_orch.transfer.batch import PaddedBatch, Sample
from rlhf_orch.transfer.engine_side import padded_per_micro_batch
from rlhf_orch.transfer.plan import interleave_over_engines, plan_count_micro_batches


class MicroBatchedTransfer(RolloutTransfer):
    def layout(self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int) -> list[list[MicroBatch]]:
        return [
            [PaddedBatch.from_samples(mb, pad_id) for mb in shard]
            for shard in count_micro_batches(samples, num_shards, micro_batch_size)
        ]

    def deliver(self, request: RolloutRequest, route: Route) -> Delivery:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        works = plan_count_micro_batches(
            len(request.prompts), request.samples_per_prompt, request.num_shards, request.micro_batch_size
        )
        batch_format = padded_per_micro_batch(request.pad_id)
        streams = []
        for engine, share in zip(route.engines, interleave_over_engines(works, len(route.engines))):
            if not share:
                continue
            needed = sorted({r.prompt_index for w in share for r in w.requests})
            streams.append(
                engine.produce_micro_batches.options(
                    num_returns="streaming", _generator_backpressure_num_objects=self.max_in_flight
                ).remote(share, request.job(needed, request.scorer), batch_format)
            )

        in_flight: list[list[ray.ObjectRef]] = []  # stage calls per handed-out micro-batch, oldest first
        staged_bytes: list[ray.ObjectRef] = []
        metas, wire_bytes, wire_tokens = [], 0, 0
        t_first = None
        active = list(streams)
        while active:
            ready, _ = ray.wait(active, num_returns=1)
            for stream in ready:
                try:
                    ref = next(stream)
                except StopIteration:
                    active.remove(stream)
                    continue
                ticket = route.get([ref], "generating", engine_call=True)[0]
                t_first = t_first or time.perf_counter()
                calls = [
                    actor.stage_micro_batch.remote(ticket.shard, ticket.slot, ticket.num_slots, ticket.batch)
                    for actor in route.consumers[ticket.shard]
                ]
                in_flight.append(calls)
                staged_bytes.append(calls[0])
                metas.append(ticket.meta)
                wire_bytes += ticket.nbytes
                wire_tokens += ticket.wire_tokens
                while len(in_flight) >= self.max_in_flight:
                    route.get(in_flight.pop(0), "handing experience to the trainers")
        t_generated = time.perf_counter()
        route.get([c for calls in in_flight for c in calls], "handing experience to the trainers")
        t_end = time.perf_counter()
        timings["generate"] = t_generated - t0
        timings["reward"] = 0.0  # scored on the engines, inside generation (meta.score_s)
        timings["transfer"] = t_end - (t_first or t_end)  # from the first micro-batch (streaming)
        timings["transfer_after_generate"] = t_end - t_generated  # what the step waits for
        return Delivery(meta=merge_meta(metas), wire_bytes=wire_bytes, wire_tokens=wire_tokens, timings=timings)
