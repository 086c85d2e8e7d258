"""What an engine does with its completions so the driver never holds experience.

`RolloutProducer` is a part of an engine (the vLLM engine's `engines.rollouts.VLLMRollouts`, or the
benchmark's synthetic engine). The engine supplies two things -- `_complete` (finished completions, request by request,
as soon as each finishes) and `_decode` (token ids -> text, for rule rewards) -- and gets:

* `produce_samples`      the honest baseline: every sample back to the caller (the driver).
* `produce_micro_batches` a generator: each count-based micro-batch is scored, laid out and
                          `ray.put` by the engine the moment its last sequence finishes; the caller
                          receives a small `MicroBatchTicket` (an object ref + lengths + rewards).
* `produce_and_hold` +    generate, packing each sequence into flat buffers here as it finishes
  `cut_for_ranks`         (`PackedBuffer`), score, return only lengths/rewards; then, once the
                          caller has planned token-budget micro-batches, gather one packed piece
                          per trainer rank from the buffers (one object per rank, refs returned).
  `held_samples` /        what is held, as `Sample`s, and back (a checkpoint of a held rollout).
  `hold_samples`
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import ray
import torch

from rlhf_orch.reward.base import Response
from rlhf_orch.reward.combine import sample_reward
from rlhf_orch.reward.execution import ScoredBatch
from rlhf_orch.transfer.batch import LOSS_MASK, PaddedBatch, Sample
from rlhf_orch.transfer.packed_buffer import PackedBuffer
from rlhf_orch.transfer.plan import CompletionRequest, MicroBatchWork, group_of, is_extra_sequence
from rlhf_orch.transfer.rollout_meta import RolloutMeta

# Where an engine holds a rollout until its hand-over when it holds one at most (pipeline=async holds
# several, one per step: RolloutRequest.slot).
ONLY_SLOT = 0

# (prompts, responses, on_scored) -> ScoredBatch: scores one batch where the samples are
# (rlhf_orch.reward.scoring), calling on_scored() as it moves (the engine's liveness count).
Scorer = Callable[[Sequence[Any], Sequence[Response], Callable[[], None]], ScoredBatch]


@dataclass
class Completion:
    """One finished sequence, as an engine hands it to `RolloutProducer`."""

    index: int  # global sample index
    prompt_ids: list[int] | torch.Tensor
    response_ids: list[int] | torch.Tensor
    logprobs: list[float] | torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # further per-token fields (benchmark)
    truncated: bool = False  # stopped at max_tokens, not at EOS (overlong shaping reads it)
    # Multi-turn trajectories (`env`): the environment's reward and this trajectory's env counters.
    env_reward: float | None = None
    env_stats: dict[str, float] | None = None
    # The environment's own episode metrics (skyrl-gym's get_metrics), keyed by its class: (class, dict).
    env_metrics: tuple[str, dict] | None = None
    # The engine's weight version when the sequence started (None: the engine's version now). A
    # weight update while it was generating (pipeline=async) made its later tokens with newer
    # weights: `interrupted`, and its staleness counts from this, its oldest token.
    weight_version: int | None = None
    interrupted: bool = False
    token_version_mean: float | None = None  # the weight version averaged over its tokens (None: weight_version)
    # vLLM's labels of its tokens: (start, end, version) runs over the response (None: all weight_version)
    version_spans: tuple[tuple[int, int, int], ...] | None = None


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
    # Multi-turn rollouts: the `env` option (rlhf_orch.env.multi_turn.MultiTurnEnv); None: one response.
    env: Any = None
    min_tokens: int = 0  # EOS cannot end a response before this many tokens (algo.min_response_len)
    # The trainers weigh tokens by the engine's probability (algo.tis_cap / decoupled_is_cap): an agent's
    # top-p / top-k / penalised tokens may train (env=agent; without, they are context).
    corrects_engine_sampling: bool = False


def model_tokens(response_ids: Any, fields: dict[str, Any]) -> int:
    """Tokens of a response the policy generated: its loss mask's ones (observations are holes)."""
    mask = fields.get(LOSS_MASK)
    return int(torch.as_tensor(mask).sum()) if mask is not None else len(response_ids)


def rollout_meta(
    samples: Sequence[Sample],
    score_s: float = RolloutMeta.score_s,
    generated_at: float = RolloutMeta.generated_at,
    scored: ScoredBatch | None = None,
    env_stats: Sequence[dict[str, float] | None] = (),
    env_metrics: Sequence[tuple[str, dict] | None] = (),
) -> RolloutMeta:
    """The record of `samples` (in their order); `env_stats` / `env_metrics`: per sample, in the same order."""
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
        interrupted=[bool(s.interrupted) for s in samples],
        token_version_means=[
            float(s.weight_version) if s.token_version_mean is None else s.token_version_mean for s in samples
        ],
        version_spans=[s.version_spans for s in samples],
        env_stats=list(env_stats),
        env_metrics=list(env_metrics),
        model_token_lens=[model_tokens(s.response_ids, s.fields) for s in samples],
    )


def score_samples(samples: Sequence[Sample], texts: Sequence[str], job: RolloutJob) -> ScoredBatch:
    """Score decoded samples with the job's scorer and write each reward into its sample."""
    scored = _score(
        [s.index for s in samples], [len(s.response_ids) for s in samples], [s.truncated for s in samples], texts, job
    )
    for sample, score in zip(samples, scored.scores):
        sample.reward = float(score)
    return scored


class RolloutProducer(abc.ABC):
    weight_version: int = Sample.weight_version  # the weights an engine starts with (a sample's first version)

    @abc.abstractmethod
    def _complete(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> Iterator[list[Completion]]:
        """Yield each request's completions (all `count` of them) as soon as that request finishes."""

    @abc.abstractmethod
    def _decode(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        """Response texts, special tokens skipped (what the rule reward reads)."""

    def _sample_scored(self) -> None:
        """One more sample scored here: an engine with a liveness count (`VLLMEngine.progress`)
        counts it, so a slow verifier scoring a large share is not taken for a stuck engine."""

    # ------------------------------------------------------------------ shared
    def _samples(
        self, completions: Sequence[Completion], job: RolloutJob
    ) -> tuple[list[Sample], float, ScoredBatch | None]:
        t = time.perf_counter()
        samples = [
            Sample(
                prompt_ids=torch.as_tensor(c.prompt_ids, dtype=torch.long),
                response_ids=torch.as_tensor(c.response_ids, dtype=torch.long),
                reward=float("nan"),  # scored below, or elsewhere (the padded baseline's driver)
                engine_logprobs=torch.as_tensor(c.logprobs, dtype=torch.float32),
                # the version it started with: an update while it generated (pipeline=async) made
                # only its later tokens with the engine's version now
                weight_version=self.weight_version if c.weight_version is None else c.weight_version,
                index=c.index,
                fields=c.fields,
                truncated=c.truncated,
                interrupted=c.interrupted,
                token_version_mean=c.token_version_mean,
                version_spans=c.version_spans,
            )
            for c in completions
        ]
        scored = _final_scores(
            [c.index for c in completions],
            [len(c.response_ids) for c in completions],
            [c.truncated for c in completions],
            [c.env_reward for c in completions],
            lambda: self._decode([c.response_ids for c in completions]),
            job,
            self._sample_scored,
        )
        if scored is not None:
            for sample, score in zip(samples, scored.scores):
                sample.reward = float(score)
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
            finished = sorted(done.pop(id(work)), key=lambda c: c.index)
            samples, score_s, scored = self._samples(finished, job)
            batch = batch_format(samples)
            yield MicroBatchTicket(
                shard=work.shard,
                slot=work.slot,
                num_slots=work.num_slots,
                batch=ray.put(batch),
                meta=rollout_meta(
                    samples,
                    score_s,
                    scored=scored,
                    env_stats=[c.env_stats for c in finished],
                    env_metrics=[c.env_metrics for c in finished],
                ),
                nbytes=batch.nbytes,
                wire_tokens=int(batch.input_ids.numel()),
            )

    # ------------------------------------------------------------------ hold, then cut per rank
    def _held_buffer(self, slot: int = ONLY_SLOT) -> PackedBuffer:
        """The buffers of one held rollout. Several rollouts may be held at once (pipeline=async
        generates the next steps' while one is handed over): each in its own slot (its step)."""
        # Producers are built without calling an __init__ of ours: created on first use.
        if getattr(self, "_held", None) is None:
            self._held = {}
        if slot not in self._held:
            self._held[slot] = PackedBuffer()
        return self._held[slot]

    def produce_and_hold(
        self, requests: Sequence[CompletionRequest], job: RolloutJob, slot: int = ONLY_SLOT
    ) -> RolloutMeta:
        """Generate, packing each sequence into this engine's flat buffers (of `slot`) as it
        finishes; score; return only the metadata. Added to what is held: dynamic sampling may ask
        for several rounds before one cut (an index generated again replaces the one held)."""
        held = self._held_buffer(slot)
        expected = sum(r.count for r in requests)
        # Room for the longest possible responses: pages are only mapped where sequences land.
        held.reserve(
            sum(r.count * len(job.prompt_ids[r.prompt_index]) for r in requests) + expected * job.max_tokens, expected
        )
        rows: list[int] = []
        texts_of: list[Any] = []  # response ids, as the engine gave them (what `_decode` reads)
        env_rewards: list[float | None] = []
        env_stats: list[dict[str, float] | None] = []
        env_metrics: list[tuple[str, dict] | None] = []
        generated: list[int] = []  # model tokens per completion
        versions: list[int] = []
        token_versions: list[float] = []
        spans: list[Any] = []
        interrupted: list[bool] = []
        last_prompt: tuple[Any, Any] = (None, None)  # the samples of one prompt share its ids
        for done in self._complete(requests, job):
            for c in done:
                if c.prompt_ids is not last_prompt[0]:
                    last_prompt = (c.prompt_ids, torch.as_tensor(c.prompt_ids, dtype=torch.long))
                version = self.weight_version if c.weight_version is None else c.weight_version
                rows.append(
                    held.append(
                        last_prompt[1],
                        c.response_ids,
                        c.logprobs,
                        c.fields,
                        index=c.index,
                        weight_version=version,
                        truncated=c.truncated,
                    )
                )
                versions.append(version)
                token_versions.append(float(version) if c.token_version_mean is None else c.token_version_mean)
                spans.append(c.version_spans)
                interrupted.append(bool(c.interrupted))
                texts_of.append(c.response_ids)
                env_rewards.append(c.env_reward)
                env_stats.append(c.env_stats)
                env_metrics.append(c.env_metrics)
                generated.append(model_tokens(c.response_ids, c.fields))
        t = time.perf_counter()
        info = held.scalars(rows)
        order = sorted(range(len(rows)), key=info["index"].__getitem__)
        rows = [rows[k] for k in order]
        versions = [versions[k] for k in order]
        token_versions = [token_versions[k] for k in order]
        spans = [spans[k] for k in order]
        indices = [info["index"][k] for k in order]
        seq_lens = [info["seq_len"][k] for k in order]
        response_lens = [info["seq_len"][k] - info["prompt_len"][k] for k in order]
        truncated = [info["truncated"][k] for k in order]
        rewards = [float("nan")] * len(rows)  # scored here, or elsewhere (the padded baseline's driver)
        scored = _final_scores(
            indices,
            response_lens,
            truncated,
            [env_rewards[k] for k in order],
            lambda: self._decode([texts_of[k] for k in order]),
            job,
            self._sample_scored,
        )
        if scored is not None:
            rewards = [float(x) for x in scored.scores]
            held.set_scores(rows, rewards)
        score_s = time.perf_counter() - t
        held.reserve_cut()  # the hand-over's output buffer, mapped now rather than during it
        generated_at = time.time()  # rollout ready (generated, packed and scored)
        return RolloutMeta(
            indices=indices,
            seq_lens=seq_lens,
            response_lens=response_lens,
            rewards=rewards,
            score_s=score_s,
            generated_at=generated_at,
            reward_errors=scored.errors if scored else 0,
            reward_timeouts=scored.timeouts if scored else 0,
            truncated=truncated,
            weight_versions=versions,
            env_stats=[env_stats[k] for k in order],
            env_metrics=[env_metrics[k] for k in order],
            interrupted=[interrupted[k] for k in order],
            token_version_means=token_versions,
            version_spans=spans,
            model_token_lens=[generated[k] for k in order],
        )

    def held_samples(self, slot: int = ONLY_SLOT) -> list[Sample]:
        """What this engine holds in `slot`, as `Sample`s in index order (a checkpoint of a
        rollout not handed over yet)."""
        held = self._held_buffer(slot)
        return held.samples(held.rows(sorted(held.row_of)))

    def hold_samples(self, samples: Sequence[Sample], slot: int = ONLY_SLOT) -> None:
        """Hold `samples` in `slot` as if this engine had generated them (a resumed checkpoint's rollout)."""
        held = self._held_buffer(slot)
        held.clear()
        held.reserve(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples), len(samples))
        for s in samples:
            held.append(
                s.prompt_ids,
                s.response_ids,
                s.engine_logprobs,
                s.fields,
                index=s.index,
                weight_version=s.weight_version,
                truncated=s.truncated,
                reward=float(s.reward),
            )
        held.reserve_cut()

    def produce_scores(self, requests: Sequence[CompletionRequest], job: RolloutJob) -> RolloutMeta:
        """Generate and score, keep nothing: lengths and rewards only (evaluation)."""
        completions = [c for done in self._complete(requests, job) for c in done]
        completions = sorted(completions, key=lambda c: c.index)
        samples, score_s, scored = self._samples(completions, job)
        return rollout_meta(
            samples,
            score_s,
            time.time(),
            scored,
            [c.env_stats for c in completions],
            [c.env_metrics for c in completions],
        )

    def cut_for_ranks(
        self, members_per_rank: Sequence[Sequence[Sequence[int]]], slot: int = ONLY_SLOT, release: bool = True
    ) -> Any:
        """One packed piece per rank (None where this engine holds nothing for it).

        `members_per_rank[rank][micro_batch]`: the sequences this engine holds for that
        micro-batch. A piece lists them micro-batch after micro-batch, so the trainer cuts each
        micro-batch's part as a view. Called with `num_returns=len(members_per_rank)`: each piece
        is its own object and a trainer fetches only its own. Everything `slot` held is released --
        or, `release=False`, kept until `release_held` (a hand-over that may be cut again: another
        engine died during it, and the plan changes with that engine's share drawn again).
        """
        # The sequences are already packed (as they finished): each piece is gathered from the
        # flat buffers by index ranges, one copy per field and run of adjacent sequences.
        start = time.time()
        held = self._held_buffer(slot)
        pieces = held.cut([held.rows(i for mb in micro_batches for i in mb) for micro_batches in members_per_rank])
        if release:
            self.release_held(slot)
        # Ray writes the pieces into the object store after this returns (not timed here).
        self._last_cut = {
            "start": start,
            "gathered": time.time(),
            "nbytes": sum(p.nbytes for p in pieces if p is not None),
        }
        return pieces[0] if len(pieces) == 1 else tuple(pieces)

    def release_held(self, slot: int = ONLY_SLOT) -> None:
        """Let go of everything `slot` holds (its rollout is on the trainers)."""
        self._held_buffer(slot).clear()
        if slot:  # a step's slot is not used again (slot 0 keeps its pages for the next rollout)
            del self._held[slot]

    def last_cut_timing(self) -> dict[str, float]:
        """Wall-clock stamps of the last `cut_for_ranks` (a profile of the hand-over)."""
        return dict(getattr(self, "_last_cut", {}))


def _score(
    indices: Sequence[int],
    response_lens: Sequence[int],
    truncated: Sequence[bool],
    texts: Sequence[str],
    job: RolloutJob,
    on_scored: Callable[[], None] = lambda: None,
) -> ScoredBatch:
    prompts = [job.prompts[group_of(i, job.samples_per_prompt)] for i in indices]
    return job.scorer(prompts, [Response(t, n, tr) for t, n, tr in zip(texts, response_lens, truncated)], on_scored)


def _final_scores(
    indices: Sequence[int],
    response_lens: Sequence[int],
    truncated: Sequence[bool],
    env_rewards: Sequence[float | None],
    texts: Callable[[], Sequence[str]],
    job: RolloutJob,
    on_scored: Callable[[], None] = lambda: None,
) -> ScoredBatch | None:
    """The samples' rewards where they were generated: the rule's score of each response, or with
    an environment the trajectory's reward plus env.reward_weight x the rule's score of the decoded
    transcript (scored only when that weight is not 0). None: scored elsewhere (no rule, no env).
    `on_scored` after each sample the rule scored (the engine's liveness count)."""
    if job.env is None:
        return None if job.scorer is None else _score(indices, response_lens, truncated, texts(), job, on_scored)
    weight = float(getattr(job.env, "reward_weight", 0.0))
    if not weight or job.scorer is None:
        return ScoredBatch([sample_reward(None, 1.0, env=e, env_weight=weight) for e in env_rewards], 0, 0, 0.0, None)
    rule = _score(indices, response_lens, truncated, texts(), job, on_scored)
    # (the rule's scores come weighted by reward.rule_weight: RuleScoring)
    scores = [sample_reward(r, 1.0, env=e, env_weight=weight) for e, r in zip(env_rewards, rule.scores)]
    return ScoredBatch(scores, rule.errors, rule.timeouts, rule.seconds, rule.first_error)


def _request_of(completions: list[Completion], job: RolloutJob) -> CompletionRequest:
    # A trajectory's further sequences (env=agent) come with it; the request counted trajectories.
    trajectories = [c.index for c in completions if not is_extra_sequence(c.index)]
    prompt, sample = divmod(min(trajectories), job.samples_per_prompt)
    return CompletionRequest(prompt, sample, len(trajectories))


def padded_per_micro_batch(pad_id: int) -> Callable[[list[Sample]], PaddedBatch]:
    """A picklable `batch_format`: pad to this micro-batch's longest sequence only."""
    import functools

    return functools.partial(PaddedBatch.from_samples, pad_id=pad_id)
