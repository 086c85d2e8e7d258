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

from rlhf_orch.transfer.base import Delivery, MicroBatch, RolloutRequest, RolloutTransfer, Route, count_micro_batches
from rlhf_orch.transfer.rollout_meta import RolloutMeta
from rlhf_orch.transfer.batch import PaddedBatch, Sample
from rlhf_orch.transfer.engine_side import padded_per_micro_batch
from rlhf_orch.transfer.plan import interleave_over_engines, plan_count_micro_batches


class MicroBatchedTransfer(RolloutTransfer):
    holds_rollouts = False  # micro-batches go to the trainers while the engines generate

    def __init__(self, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"transfer.max_in_flight={max_in_flight} must be >= 1")
        self.max_in_flight = max_in_flight

    def layout(
        self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int
    ) -> list[list[MicroBatch]]:
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
        shares = {e: share for e, share in enumerate(interleave_over_engines(works, len(route.engines))) if share}

        def open_stream(e: int, share):
            needed = sorted({r.prompt_index for w in share for r in w.requests})
            return (
                route.engines[e]
                .produce_micro_batches.options(
                    num_returns="streaming", _generator_backpressure_num_objects=self.max_in_flight
                )
                .remote(share, request.job(needed, request.scorer), batch_format)
            )

        active = {open_stream(e, share): e for e, share in shares.items()}
        handed: set[tuple[int, int]] = set()  # (shard, slot) of every micro-batch staged or on its way
        died: list[int] = []  # engines that died; replaced once the other streams are drained
        in_flight: list[list[ray.ObjectRef]] = []  # stage calls per handed-out micro-batch, oldest first
        metas, wire_bytes, wire_tokens = [], 0, 0
        t_first = None
        while active or died:
            if not active:
                # Replaced only now: the other engines' streams wait on this loop (back-pressure),
                # so re-forming the weight group earlier would wait on them forever.
                for e in died:
                    route.engines[e] = route.replace(e)
                    rest = [w for w in shares[e] if (w.shard, w.slot) not in handed]
                    if rest:
                        active[open_stream(e, rest)] = e
                died = []
                continue
            ready = route.wait_any(active)
            if not ready:  # a stuck engine must not hang the run (one that makes engine steps is waited for)
                raise TimeoutError(f"no micro-batch from the engines while generating: {route.stall_note()}")
            for stream in ready:
                ref = None
                try:
                    ref = next(stream)
                    ticket = ray.get(ref, timeout=route.timeout_s)
                except StopIteration:
                    del active[stream]
                    continue
                except ray.exceptions.RayActorError:
                    if not route.replaces_engines:
                        raise
                    died.append(active.pop(stream))
                    continue
                except ray.exceptions.RayError:
                    if ref is None:
                        raise
                    route.get([ref], "generating", engine_call=True)  # the loop's one-line error
                    raise
                t_first = t_first or time.perf_counter()
                handed.add((ticket.shard, ticket.slot))
                calls = [
                    actor.stage_micro_batch.remote(ticket.shard, ticket.slot, ticket.num_slots, ticket.batch)
                    for actor in route.consumers[ticket.shard]
                ]
                in_flight.append(calls)
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
        return Delivery(meta=RolloutMeta.merge(metas), wire_bytes=wire_bytes, wire_tokens=wire_tokens, timings=timings)
