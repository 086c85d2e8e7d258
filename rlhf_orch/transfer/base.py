"""The interface of the `transfer` group: how a step's rollout gets from the engines to the trainers.

A strategy has two halves:

* `layout(samples, ...)` -- pure: samples -> per-shard micro-batches, exactly what its trainers
  end up holding. Tests compare strategies through it without Ray.
* `deliver(request, route)` -- the distributed data path: which engine makes what, who packs it,
  and how it reaches the trainer ranks. The driver keeps only `Delivery` (lengths, rewards, sizes,
  timings); experience tensors stay in the object store between actors except in the padded
  baseline, which gathers on the driver on purpose.

A strategy that can hold a finished rollout until the trainers are free (`holds_rollouts`) also
splits `deliver` into `generate(request, route) -> HeldRollout` (the engines, or the driver, hold
it; no trainer is touched) and `hand_over(held, route) -> Delivery`: the one-step off-policy
pipeline generates the next rollout while the trainers train on this one. `export_held` /
`import_held` move a held rollout into a checkpoint and back.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray

from rlhf_orch.liveness import ProgressWatch
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch, Sample
from rlhf_orch.transfer.micro_batches import near_equal_ranges, shard_for_ranks, split_by_count
from rlhf_orch.transfer.engine_side import ONLY_SLOT, RolloutJob, Scorer
from rlhf_orch.transfer.rollout_meta import RolloutMeta
from rlhf_orch.transfer.plan import check_trajectories_divide

MicroBatch = PaddedBatch | PackedBatch


@dataclass
class RolloutRequest:
    """One step's rollout, as the driver asks for it."""

    prompts: list[Any]  # the task's prompt objects (what the scorer reads)
    prompt_ids: list[list[int]]
    samples_per_prompt: int
    max_tokens: int
    temperature: float
    scorer: Scorer | None  # None: no rule reward (a reward model scores the sequences later)
    num_shards: int  # data-parallel ranks of the policy
    micro_batch_size: int
    pad_id: int
    max_seq_len: int  # prompt_max_len + response_max_len
    decode: Callable[[list[list[int]]], list[str]] | None = None  # driver-side decoding (baseline only)
    env: Any = None  # multi-turn rollouts: the `env` option (None: one response per sample)
    min_tokens: int = RolloutJob.min_tokens  # algo.min_response_len
    # Where the engines hold this rollout until its hand-over: several may be held at once
    # (pipeline=async); 0 when one at most is.
    slot: int = ONLY_SLOT
    # Sequences per optimizer step (algo.train_batch_size): a token budget is lowered so every rank
    # gets at least one micro-batch per optimizer step (0: no floor).
    train_batch_size: int = 0
    corrects_engine_sampling: bool = RolloutJob.corrects_engine_sampling  # algo.tis_cap / decoupled_is_cap set

    def job(self, prompt_indices: Sequence[int], scorer: Scorer | None) -> RolloutJob:
        return RolloutJob(
            prompt_ids={p: self.prompt_ids[p] for p in prompt_indices},
            prompts={p: self.prompts[p] for p in prompt_indices},
            samples_per_prompt=self.samples_per_prompt,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            scorer=scorer,
            env=self.env,
            min_tokens=self.min_tokens,
            corrects_engine_sampling=self.corrects_engine_sampling,
        )


@dataclass
class Route:
    """The actors a delivery talks to, how to wait on them, and who replaces an engine that died."""

    engines: list[Any]
    consumers: list[list[Any]]  # per shard: every actor that must stage it (policy, critic, reference)
    get: Callable[..., list[Any]]  # get(refs, what, engine_call=False) with the loop's timeout/errors
    wait: Callable[..., Any] = ray.wait
    # The engines' owner (`rlhf_orch.orchestration.fleet.EngineFleet`, passed down: `replace`), and the
    # step whose rollout the engines make (a replacement is seeded for it). None: a dead engine fails the step.
    fleet: Any = None
    step: int | None = None
    timeout_s: float = 600.0
    # the engines' counts at the last look (wait_any); a replacement, another handle, starts with a first look
    _watch: ProgressWatch | None = None
    # the engines the last wait found stuck (wait_any returned []), for the error that follows
    stalled: list[int] = field(default_factory=list)

    @property
    def replaces_engines(self) -> bool:
        return self.fleet is not None

    def replace(self, e: int, dead: Any = None) -> Any:
        """A new engine in engine e's bundle holding the current weights, or the one that already
        replaced `dead` (the handle that failed)."""
        return self.fleet.replace(e, step=self.step, dead=dead)

    def wait_any(self, waiting: dict[Any, int]) -> list[Any]:
        """The first of `waiting` (Ray refs or streaming generators, each -> the engine making it)
        that is ready, or [] for a stuck engine. Liveness by progress, not by wall time: after each
        `timeout_s` (fault.step_timeout_s) with none ready, every engine still at work is asked for
        its engine steps so far (`VLLMEngine.progress`, answered beside a running generation); if
        each made steps since the last look, the wait goes on -- a generation producing tokens is
        never cut, however long -- else [] (the caller reports no answer in time). A stuck engine
        (its vLLM thread included) is found within two windows, whatever the response length."""
        if self._watch is None:
            self._watch = ProgressWatch(self.timeout_s)  # each engine must move (they do not wait on each other)
        ready = self._watch.first_ready(list(waiting), {e: self.engines[e] for e in sorted(set(waiting.values()))})
        self.stalled = self._watch.stalled
        return ready

    def stall_note(self) -> str:
        """Which engines the last wait found stuck, for the one-line error."""
        engines = ", ".join(map(str, self.stalled))
        return (
            f"vLLM engine{'s' if len(self.stalled) > 1 else ''} {engines} made no engine step within "
            f"{self.timeout_s:g}s (fault.step_timeout_s) or did not answer"
        )

    def on_engines(
        self, submit: Callable[[int, Any], ray.ObjectRef], engines: Sequence[int], what: str
    ) -> dict[int, Any]:
        """Per engine index, the result of `submit(e, engine)`.

        An engine that dies is replaced and its call submitted again to the replacement: what it
        had made died with it, what the other engines made stands, so every sample is made once.
        """
        pending = {submit(e, self.engines[e]): e for e in engines}
        results: dict[int, Any] = {}
        while pending:
            ready = self.wait_any(pending)
            if not ready:
                # Give up on the stuck engines whose calls are still out; one that answered just now
                # (or failed: replaced below) is taken by the next wait.
                _, late = ray.wait(list(pending), num_returns=len(pending), timeout=0)
                self.stalled = [e for e in self.stalled if e in {pending[ref] for ref in late}]
                if self.stalled:
                    self.get(late, f"{what}: {self.stall_note()}", engine_call=True, remaining_s=0.0)  # raises
                continue
            ref = ready[0]
            e = pending.pop(ref)
            try:
                results[e] = ray.get(ref)
            except ray.exceptions.RayActorError:
                if not self.replaces_engines:
                    self.get([ref], what, engine_call=True)  # the loop's one-line error for it (EngineDiedError)
                    raise
                self.engines[e] = self.replace(e, dead=self.engines[e])
                pending[submit(e, self.engines[e])] = e
            except ray.exceptions.RayError:
                self.get([ref], what, engine_call=True)  # the loop's one-line error for it
        return results


@dataclass
class Delivery:
    """What the driver keeps of a step's rollout: metadata, never experience tensors."""

    meta: RolloutMeta  # by global sample index
    wire_bytes: int
    wire_tokens: int  # token positions moved (padding included)
    timings: dict[str, float] = field(default_factory=dict)
    dropped_groups: int | None = None  # dynamic sampling: prompt groups generated and dropped
    rounds: int = 1  # dynamic sampling: rollout rounds it took to fill the batch

    @property
    def real_tokens(self) -> int:
        return sum(self.meta.seq_lens)


@dataclass
class EngineShare:
    """What one engine process made of a held rollout: the prompts (indices into the request's
    prompts) whose samples it holds. The handle says which process: one replaced since took them
    along (`EngineFleet.redraw_lost_shares`)."""

    engine: Any
    prompts: list[int]


@dataclass
class HeldRollout:
    """A generated and scored rollout that no trainer holds yet (`generate` -> `hand_over`).

    `meta` is by global sample index; `held` is what the strategy keeps where it keeps it (per
    engine, the indices it holds for packed; the samples themselves for the padded baseline).
    Everything the hand-over needs besides the route travels here, so a checkpoint can carry it.
    The driver also keeps, never in a checkpoint, where each share was made (`shares`, per engine)
    and how to make it again: the `request` (its prompts), or for a rollout restored from a
    checkpoint its `samples` (per engine) -- an engine lost while holding its share (pipeline=async)
    has it drawn again, or held again, on its replacement.
    """

    meta: RolloutMeta
    held: Any
    num_shards: int
    micro_batch_size: int
    pad_id: int
    max_seq_len: int
    timings: dict[str, float] = field(default_factory=dict)
    dropped_groups: int | None = None
    rounds: int = 1
    step: int = 0  # the training step it was generated for (set by the loop)
    slot: int = ONLY_SLOT  # where the engines hold it (RolloutRequest.slot)
    train_batch_size: int = RolloutRequest.train_batch_size
    ready_at: float = field(default_factory=time.time)  # wall clock when `generate` returned
    request: Any = None  # the RolloutRequest it was made for (driver only)
    shares: list[list[EngineShare]] | None = None  # per engine, what each of its processes made (driver only)
    samples: list[list[Sample]] | None = None  # a restored rollout's samples, per engine (driver only)

    def __setstate__(self, state: dict) -> None:
        # (a checkpoint written before the driver-only fields existed)
        self.__dict__.update({"request": None, "shares": None, "samples": None, **state})

    def for_checkpoint(self, held: Any) -> "HeldRollout":
        """A copy that carries `held` (the samples) and nothing of the driver's."""
        return dataclasses.replace(self, held=held, request=None, shares=None, samples=None)

    def waited(self) -> float:
        """Seconds between `generate` returning and now (a one-step-off rollout waits for the trainers)."""
        return max(time.time() - self.ready_at, 0.0)


class RolloutTransfer(abc.ABC):
    # Can a finished rollout wait for the trainers (generate/hand_over)? A streaming strategy
    # cannot: it hands micro-batches to the trainers while generating.
    holds_rollouts: bool = True
    # The engines score what they generate (multi-turn environments live there); the padded
    # baseline scores on the driver instead.
    scores_on_engines: bool = True

    @abc.abstractmethod
    def layout(
        self, samples: Sequence[Sample], num_shards: int, micro_batch_size: int, pad_id: int
    ) -> list[list[MicroBatch]]:
        """Per shard, the micro-batches it trains on (every sample exactly once)."""

    def deliver(self, request: RolloutRequest, route: Route) -> Delivery:
        """Generate the rollout and leave every shard staged on its consumers."""
        return self.hand_over(self.generate(request, route), route)

    def generate(self, request: RolloutRequest, route: Route) -> HeldRollout:
        """Generate and score the rollout; hold it (on the engines or here), stage nothing."""
        raise NotImplementedError(f"{type(self).__name__} streams into the trainers: it cannot hold a rollout")

    def hand_over(self, held: HeldRollout, route: Route) -> Delivery:
        """Stage a held rollout's shards on their consumers."""
        raise NotImplementedError(f"{type(self).__name__} streams into the trainers: it cannot hold a rollout")

    def export_held(self, held: HeldRollout, route: Route) -> HeldRollout:
        """A copy of `held` that carries its samples (for a checkpoint); the engines keep theirs."""
        return held

    def import_held(self, held: HeldRollout, route: Route) -> HeldRollout:
        """Put an exported rollout back where `hand_over` expects it (after a resume)."""
        return held

    def redraw(self, held: HeldRollout, route: Route, engines: Sequence[int]) -> int:
        """Make the shares of `engines` (their processes replaced since they made them) again on
        their current processes, in place (only strategies that hold rollouts on the engines);
        the samples made or held again."""
        raise NotImplementedError(f"{type(self).__name__} holds no rollout on the engines")

    # ------------------------------------------------------------------ shared helper
    @staticmethod
    def _stage_all(route: Route, calls_for_shard: Callable[[int, Any], ray.ObjectRef]) -> list[ray.ObjectRef]:
        return [calls_for_shard(shard, actor) for shard, actors in enumerate(route.consumers) for actor in actors]

    @staticmethod
    def _timed(timings: dict[str, float], key: str, t0: float) -> float:
        now = time.perf_counter()
        timings[key] = now - t0
        return now


def count_micro_batches(samples: Sequence[Sample], num_shards: int, micro_batch_size: int) -> list[list[list[Sample]]]:
    """Contiguous shards of equal size, each cut into micro-batches of `micro_batch_size`.

    With trajectories that train as several sequences (`plan.extra_sequence_index`) the count
    need not divide over the shards: the shards then differ by at most one sequence, and every
    shard is cut into the same number of micro-batches (ranks step in lockstep), each at most
    `micro_batch_size` but one larger where a shard has a sequence more than the others."""
    check_trajectories_divide([s.index for s in samples], num_shards)
    if len(samples) % num_shards == 0:
        shards = shard_for_ranks(len(samples), num_shards)
        cuts = [split_by_count(len(shard), micro_batch_size) for shard in shards]
    else:
        shards = near_equal_ranges(len(samples), num_shards)
        count = -(-len(shards[-1]) // micro_batch_size)  # the smallest shard's micro-batches
        cuts = [near_equal_ranges(len(shard), count) for shard in shards]
    out = []
    for shard, cut in zip(shards, cuts):
        rows = [samples[i] for i in shard]
        out.append([[rows[i] for i in r] for r in cut])
    return out
