"""Baseline: the driver gathers every sample, pads all of them to the batch's longest, sends shards.

This is the data path that does not scale (OpenRLHF's before its fixes), kept as the honest
reference point: engines return whole samples to the driver, the driver scores them, pads every
field to the global max length and puts one object per shard.
"""

from __future__ import annotations

import time
from typing import Sequence

import ray

from rlhf_orch.transfer.base import (
    Delivery,
    HeldRollout,
    MicroBatch,
    RolloutRequest,
    RolloutTransfer,
    Route,
    count_micro_batches,
)
from rlhf_orch.transfer.batch import PaddedBatch, Sample
from rlhf_orch.transfer.engine_side import rollout_meta, score_samples
from rlhf_orch.transfer.plan import prompt_chunks, whole_prompt_requests


class PaddedTransfer(RolloutTransfer):
    scores_on_engines = False  # the driver scores the gathered samples (the baseline's point)

    def layout(
        self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int
    ) -> list[list[MicroBatch]]:
        global_max = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return [
            [PaddedBatch.from_samples(mb, pad_id, pad_to=global_max) for mb in shard]
            for shard in count_micro_batches(samples, num_shards, micro_batch_size)
        ]

    def generate(self, request: RolloutRequest, route: Route) -> HeldRollout:
        timings: dict[str, float] = {}
        t = time.perf_counter()
        chunks = {e: c for e, c in enumerate(prompt_chunks(len(request.prompts), len(route.engines))) if len(c)}
        parts = route.on_engines(
            lambda e, engine: engine.produce_samples.remote(
                whole_prompt_requests(chunks[e], request.samples_per_prompt), request.job(chunks[e], None)
            ),
            list(chunks),
            "generating",
        ).values()
        samples = sorted((s for part, _ in parts for s in part), key=lambda s: s.index)
        generated_at = max(at for _, at in parts)  # the engines' clock: generation end, before the gather
        t = self._timed(timings, "generate", t)

        scored = None
        if request.scorer is not None:
            texts = request.decode([s.response_ids.tolist() for s in samples])
            scored = score_samples(samples, texts, request.job(range(len(request.prompts)), request.scorer))
        self._timed(timings, "reward", t)
        meta = rollout_meta(samples, generated_at=generated_at, scored=scored)
        return HeldRollout(
            meta=meta,
            held=samples,  # on the driver: this baseline gathers on purpose
            num_shards=request.num_shards,
            micro_batch_size=request.micro_batch_size,
            pad_id=request.pad_id,
            max_seq_len=request.max_seq_len,
            timings=timings,
        )

    def hand_over(self, held: HeldRollout, route: Route) -> Delivery:
        timings = dict(held.timings)
        t = time.perf_counter()
        waited = held.waited()
        shards = self.layout(held.held, held.num_shards, held.micro_batch_size, held.pad_id)
        refs = [ray.put(shard) for shard in shards]
        route.get(
            self._stage_all(route, lambda shard, actor: actor.stage.remote(shard, refs[shard])),
            "handing experience to the trainers",
        )
        self._timed(timings, "hand_over", t)
        # From "generation finished" to "every trainer holds its data": the gather to the driver,
        # scoring there, padding, one put per shard, and the trainers' fetch.
        timings["transfer"] = timings["transfer_after_generate"] = time.time() - held.meta.generated_at - waited
        return Delivery(
            meta=held.meta,
            wire_bytes=sum(mb.nbytes for shard in shards for mb in shard),
            wire_tokens=sum(int(mb.input_ids.numel()) for shard in shards for mb in shard),
            timings=timings,
        )
