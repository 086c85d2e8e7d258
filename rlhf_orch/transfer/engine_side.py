"""What an engine does with its completions so the driver never holds experience.

`RolloutProducer` is mixed into an engine actor (the vLLM engine, or the benchmark's synthetic
one). The engine supplies two things -- `_complete` (finished completions, request by request,
as soon as each finishes) and `_decode` (token ids -> text, for rule rewards) -- and gets:

* `produce_samples`      the honest baseline: every sample back to the caller (the driver).
* `produce_micro_batches` a generator: each count-based micro-batch is scored, laid out and
                          `ray.put` by the engine the moment its last sequence finishes; the caller
                          receives a small `MicroBatchTicket` (an object ref + lengths + rewards).
* `produce_and_hold` +    generate, score, keep the samples here, return only lengths/rewards;
  `cut_for_ranks`         then, once the caller has planned token-budget micro-batches, put one
                          packed piece per trainer rank (one object per rank, refs returned).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import ray
import torch

from rlhf_orch.reward.base import Response
from rlhf_orch.reward.execution import ScoredBatch
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, Sample
from rlhf_orch.transfer.plan import CompletionRequest, MicroBatchWork

# (prompts, responses) -> ScoredBatch: scores one batch where the samples are (rlhf_orch.reward.scoring).
Scorer = Callable[[Sequence[Any], Sequence[Response]], ScoredBatch]


@dataclass
class Completion:
    """One finished sequence, as an engine hands it to `RolloutProducer`."""

    index: int  # global sample index
    prompt_ids: list[int] | torch.Tensor
    response_ids: list[int] | torch.Tensor
    logprobs: list[float] | torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # further per-token fields (benchmark)
    truncated: bool = False  # stopped at max_tokens, not at EOS (overlong shaping reads it)


@dataclass
class RolloutMeta:
    """The small facts the driver keeps about sequences (never their tokens)."""

    indices: list[int]
    seq_lens: list[int]
    response_lens: list[int]
    rewards: list[float]
    score_s: float = 0.0
    generated_at: float = 0.0  # wall clock (time.time) when the engine's last sequence finished
    reward_errors: int = 0  # samples whose reward function raised (scored 0)
    reward_timeouts: int = 0  # samples whose reward function ran past reward.timeout_s (scored 0)
    truncated: list[bool] = field(default_factory=list)  # per sample: hit max_tokens
    weight_versions: list[int] = field(default_factory=list)  # per sample: the engine weights that sampled it
    model_rewards: list[float] | None = None  # reward-model scores (before weighting), by index
    rule_rewards: list[float] | None = None  # the weighted rule term, when a reward model adds to it


@dataclass
class MicroBatchTicket:
    """A finished micro-batch: where it goes, a reference to it, and its metadata."""

    shard: int
    slot: int
    num_slots: int
    batch: ray.ObjectRef
    meta: RolloutMeta
    nbytes: int
    wire_tokens: int  # token positions on the wire (padding included)


@dataclass
class RolloutJob:
    """Everything an engine needs to produce its share (the same for all strategies)."""

    prompt_ids: dict[int, list[int]]  # prompt index -> token ids
    prompts: dict[int, Any]  # prompt index -> the task's prompt object (scorer's first argument)
    samples_per_prompt: int
    max_tokens: int
    temperature: float
    scorer: Scorer | None  # None: rewards are computed elsewhere (the padded baseline's driver)


def rollout_meta(
    samples: Sequence[Sample], score_s: float = 0.0, generated_at: float = 0.0, scored: ScoredBatch | None = None
) -> RolloutMeta:
    return RolloutMeta(
        indices=[s.index for s in samples],
        seq_lens=[len(s.prompt_ids) + len(s.response_ids) for s in samples],
        response_lens=[len(s.response_ids) for s in samples],
        rewards=[float(s.reward) for s in samples],
        score_s=score_s,
        generated_at=generated_at,
        reward_errors=scored.errors if scored else 0,
        reward_timeouts=scored.timeouts if scored else 0,
        truncated=[s.truncated for s in samples],
        weight_versions=[int(s.weight_version) for s in samples],
    )


def score_samples(samples: Sequence[Sample], texts: Sequence[str], job: RolloutJob) -> ScoredBatch:
    """Score decoded samples with the job's scorer and write each reward into its sample."""
    prompts = [job.prompts[s.index // job.samples_per_prompt] for s in samples]
    responses = [Response(t, len(s.response_ids), s.truncated) for s, t in zip(samples, texts)]
    scored = job.scorer(prompts, responses)
    for sample, score in zip(samples, scored.scores):
        sample.reward = float(score)
    return scored


class RolloutProducer(abc.ABC):
    weight_version: int = 0

    @abc.abstractmethod
    def _complete(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> Iterator[list[Completion]]:
        """Yield each request's completions (all `count` of them) as soon as that request finishes."""

    @abc.abstractmethod
    def _decode(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        """Response texts, special tokens skipped (what the rule reward reads)."""

    # ------------------------------------------------------------------ shared
    def _samples(self, completions: Sequence[Completion], job: RolloutJob) -> tuple[list[Sample], float, ScoredBatch | None]:
        t = time.perf_counter()
        samples = [
            Sample(
                prompt_ids=torch.as_tensor(c.prompt_ids, dtype=torch.long),
                response_ids=torch.as_tensor(c.response_ids, dtype=torch.long),
                reward=float("nan"),  # scored below, or elsewhere (the padded baseline's driver)
                engine_logprobs=torch.as_tensor(c.logprobs, dtype=torch.float32),
                weight_version=self.weight_version,
                index=c.index,
                fields=c.fields,
                truncated=c.truncated,
            )
            for c in completions
        ]
        scored = None
        if job.scorer is not None:
            scored = score_samples(samples, self._decode([c.response_ids for c in completions]), job)
        return samples, time.perf_counter() - t, scored

    # ------------------------------------------------------------------ baseline: all to the caller
    def produce_samples(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> tuple[list[Sample], float]:
        """Every sample, in index order, and the wall-clock time the rollout was ready here."""
        completions = [c for done in self._complete(requests, job) for c in done]
        samples, _, _ = self._samples(sorted(completions, key=lambda c: c.index), job)
        return samples, time.time()

    # ------------------------------------------------------------------ streaming micro-batches
    def produce_micro_batches(
        self, works: Sequence[MicroBatchWork], job: RolloutJob, batch_format: Callable[[list[Sample]], Any]
    ) -> Iterator[MicroBatchTicket]:
        """Generator (a Ray streaming method): one ticket per micro-batch, in finishing order."""
        owner: dict[CompletionRequest, MicroBatchWork] = {r: w for w in works for r in w.requests}
        waiting = {id(w): len(w.requests) for w in works}
        done: dict[int, list[Completion]] = {id(w): [] for w in works}
        all_requests = [r for w in works for r in w.requests]
        for completions in self._complete(all_requests, job):
            work = owner[_request_of(completions, job)]
            done[id(work)].extend(completions)
            waiting[id(work)] -= 1
            if waiting[id(work)]:
                continue
            samples, score_s, scored = self._samples(sorted(done.pop(id(work)), key=lambda c: c.index), job)
            batch = batch_format(samples)
            yield MicroBatchTicket(
                shard=work.shard,
                slot=work.slot,
                num_slots=work.num_slots,
                batch=ray.put(batch),
                meta=rollout_meta(samples, score_s, scored=scored),
                nbytes=batch.nbytes,
                wire_tokens=int(batch.input_ids.numel()),
            )

    # ------------------------------------------------------------------ hold, then cut per rank
    def produce_and_hold(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> RolloutMeta:
        completions = [c for done in self._complete(requests, job) for c in done]
        samples, score_s, scored = self._samples(sorted(completions, key=lambda c: c.index), job)
        generated_at = time.time()  # rollout ready (generated and scored); packing counts as transfer
        # Added to what is held: dynamic sampling may ask for several rounds before one cut.
        self._held = {**getattr(self, "_held", {}), **{s.index: s for s in samples}}
        return rollout_meta(samples, score_s, generated_at, scored)

    def held_samples(self) -> list[Sample]:
        """What this engine holds (a checkpoint of a rollout not handed over yet)."""
        return [self._held[i] for i in sorted(getattr(self, "_held", {}))]

    def hold_samples(self, samples: Sequence[Sample]) -> None:
        """Hold `samples` as if this engine had generated them (a resumed checkpoint's rollout)."""
        self._held = {s.index: s for s in samples}

    def produce_scores(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> RolloutMeta:
        """Generate and score, keep nothing: lengths and rewards only (evaluation)."""
        completions = [c for done in self._complete(requests, job) for c in done]
        samples, score_s, scored = self._samples(sorted(completions, key=lambda c: c.index), job)
        return rollout_meta(samples, score_s, time.time(), scored)

    def cut_for_ranks(self, members_per_rank: Sequence[Sequence[Sequence[int]]]) -> Any:
        """One packed piece per rank (None where this engine holds nothing for it).

        `members_per_rank[rank][micro_batch]`: the sequences this engine holds for that
        micro-batch. A piece lists them micro-batch after micro-batch, so the trainer cuts each
        micro-batch's part as a view. Called with `num_returns=len(members_per_rank)`: each piece
        is its own object and a trainer fetches only its own. The held buffer is released.
        """
        # Packed straight from the samples in the cut order: one pass over the data per piece.
        held = self._held
        pieces = []
        for micro_batches in members_per_rank:
            flat = [held[i] for mb in micro_batches for i in mb]
            pieces.append(PackedBatch.from_samples(flat) if flat else None)
        self._held = {}
        return pieces[0] if len(pieces) == 1 else tuple(pieces)


def _request_of(completions: list[Completion], job: RolloutJob) -> CompletionRequest:
    first = min(c.index for c in completions)
    prompt, sample = divmod(first, job.samples_per_prompt)
    return CompletionRequest(prompt, sample, len(completions))


def padded_per_micro_batch(pad_id: int) -> Callable[[list[Sample]], PaddedBatch]:
    """A picklable `batch_format`: pad to this micro-batch's longest sequence only."""
    import functools

    return functools.partial(PaddedBatch.from_samples, pad_id=pad_id)
