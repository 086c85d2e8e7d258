"""The run's vLLM engines and their one owner, `EngineFleet`: the engine handles (in the role
actors), the weight version they hold, the pushes of new weights, their replacements (bounded by
fault.max_engine_restarts) and the record of what each engine holds of the rollouts generated ahead
(`HeldRollout.shares`, drawn again on a replacement where the pipeline allows it). The train loop
asks it for a `Route` (the engines and the trainer ranks a rollout goes to); a transfer that finds
an engine dead asks the route, which asks this fleet for the replacement -- nothing calls back into
the loop.

How a run survives the loss of an engine: a dead engine is replaced in its bundle, the weight groups
are formed again around it and the trainers' weights pushed; the shares of held rollouts it took
along are drawn again on the replacement where the pipeline allows it (async), or the loss is a lost
process that restarts the run from its checkpoint (sync, one_step_off: that repeats the
uninterrupted run).

Who finds an engine dead: a rollout thread whose call failed (`Route.on_engines` -> `replace`), a
weight push (`push` -> `_replace_after_sync`), a hand-over or a checkpoint's read of a held rollout
(`_with_lost_shares_redrawn`). One replacement at a time, never during a push or while the trainers
update (`TrainerVersion.training`), and a second finder of the same death takes the replacement the
first made.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf_orch.one_line import one_line
from rlhf_orch.orchestration.actors import PROBE_TIMEOUT_S, dead_actors, dead_or_stuck, lost_processes
from rlhf_orch.orchestration.checkpoint import engine_seed
from rlhf_orch.orchestration.errors import (
    ActorDiedError,
    ActorTimeoutError,
    EngineDiedError,
    EngineRestartBudgetError,
    StepFailedError,
)
from rlhf_orch.orchestration.restart_decision import engine_restart_refusal
from rlhf_orch.sync.base import SyncReport, WeightSync, WeightSyncError
from rlhf_orch.transfer.base import Delivery, HeldRollout, Route


def rank_per_shard(ranks: list[Any], num_shards: int) -> list[Any]:
    """Per shard, the rank of a role that takes it (round-robin), or None without the role."""
    return [ranks[shard % len(ranks)] if ranks else None for shard in range(num_shards)]


@dataclass
class TrainerVersion:
    """The trainers' side of the weights the fleet pushes: the version they hold (`trained`: the
    updates they made) and the lock the loop holds while they update (a replacement during a
    one-step-off generation waits for it, then pushes whole, labelled weights)."""

    trained: int = 0
    training: threading.Lock = field(default_factory=threading.Lock)


class EngineFleet:
    """The engines of a run: who they are, what weights they hold, who replaces them and when."""

    def __init__(
        self,
        actors: Any,
        sync: WeightSync,
        pipeline: Any,
        transfer: Any,
        settings: Any,
        trainers: TrainerVersion,
        get: Callable[..., list[Any]],
    ):
        self.actors = actors
        self.sync = sync
        self.pipeline = pipeline
        self.transfer = transfer
        self.settings = settings  # LoopSettings: seed, engine_tp, step_timeout_s, max_engine_restarts, engines_sleep
        self.trainers = trainers
        self._get = get
        self.version = 0  # the weights the engines hold
        self.last_sync: SyncReport | None = None
        self.closing = False  # the run is ending: engines that stop are not replaced
        self._replacing = (
            threading.Lock()
        )  # one engine replacement at a time (async: several rollouts may find it dead)
        # Held by whoever pushes weights or re-forms the weight groups: the main thread's push after
        # training and a rollout thread replacing a dead engine (async, one_step_off) never overlap.
        self._pushing = threading.RLock()
        # Per step whose rollout lost an engine, an entry per replacement charged to the budget (restored on
        # resume; only the entries count, their values are 0.0 -- the seconds are _restart_s'). Keyed by
        # the rollout's step: under one_step_off it is made during the step before.
        self.restart_log: dict[int, list[float]] = {}
        self.engine_restarts_before = 0  # replacements the run made before this invocation (a resumed run's)
        self._restart_s: dict[
            int, float
        ] = {}  # per step, the seconds this process spent replacing engines (time/engine_restart)
        self._redrawn: dict[
            int, int
        ] = {}  # per step, samples of its rollout drawn again after their engine was lost (fault/redrawn_samples)

    @property
    def trained(self) -> int:
        return self.trainers.trained

    @property
    def _training(self) -> threading.Lock:
        return self.trainers.training

    @property
    def engine_restarts(self) -> int:
        """Engines replaced so far in this run (resumed runs included)."""
        return sum(len(v) for v in self.restart_log.values())

    @property
    def engine_restarts_used(self) -> int:
        """Engines replaced by this invocation (what fault.max_engine_restarts bounds: a resumed
        run starts with the budget whole)."""
        return self.engine_restarts - self.engine_restarts_before

    def metrics(self, step: int) -> dict[str, Any]:
        """Step `step`'s fault metrics: replacements charged so far, the seconds spent replacing
        and the samples drawn again on replacements (the last two: this attempt's, once)."""
        metrics: dict[str, Any] = {
            "fault/engine_restarts": sum(len(v) for k, v in self.restart_log.items() if k <= step)
        }
        if step in self._restart_s:  # this attempt's replacements (the log also holds a lost attempt's)
            metrics["time/engine_restart"] = self._restart_s[step]
        if step in self._redrawn:
            metrics["fault/redrawn_samples"] = self._redrawn.pop(step)
        return metrics

    def sleep_engines(self) -> None:
        """The engines are idle until the next sync: they release their GPU memory (at sleep level
        2 their weights too, which the sync sends back before anything is generated)."""
        if self.settings.engines_sleep:
            self._get([e.sleep.remote() for e in self.actors.engines], "putting the engines to sleep", engine_call=True)

    def sync_engines(self, timings: dict[str, float]) -> None:
        """Push the trainers' weights to every engine if the engines are behind (timed as `sync`;
        the wait for the requests in flight before it, pipeline.partial_rollout=false, as `update_wait`)."""
        with self._pushing:
            if self.version == self.trained:
                return
            t = time.perf_counter()
            waited = self._push(self.trained)
            timings["sync"] = time.perf_counter() - t - waited
            if self.pipeline.finishes_requests_before_update:
                timings["update_wait"] = waited

    def _push(self, version: int) -> float:
        """Push `version` to every engine (engines lost meanwhile replaced, `_replace_after_sync`);
        the seconds spent letting the requests in flight finish first."""
        with self._pushing:
            waited = 0.0
            # An engine that died since its last call (idle, or holding rollouts: pipeline=async)
            # is replaced before the push: pushed to, its death would break the broadcast and leave
            # every other engine stuck in it (replaced too).
            dead = dead_actors(self.actors.engines, timeout_s=PROBE_TIMEOUT_S)
            if dead:
                self._replace_after_sync(dead, [], version, before=True)
                self.version = version
                return waited
            try:
                waited = self._let_requests_finish(version)
                self.last_sync = self.sync.push(version)
                self.sync.verify(version)
            except WeightSyncError:
                self._refuse_if_a_sender_died(version)
                dead, stuck = dead_or_stuck(self.actors.engines, timeout_s=PROBE_TIMEOUT_S)
                if not dead and not stuck:
                    raise  # every engine answers: not a lost process (a bug, a timeout elsewhere)
                self._replace_after_sync(dead, stuck, version)
            self.version = version
            return waited

    def _let_requests_finish(self, version: int) -> float:
        """pipeline.partial_rollout=false: the engines stop taking requests and finish the ones in
        flight before the push (waited for by their progress, however long the generation), so the
        push itself -- bounded by sync.timeout_s -- starts only when every engine can take it."""
        if not self.pipeline.finishes_requests_before_update:
            return 0.0
        t = time.perf_counter()
        route = self.route()
        what = f"letting the requests in flight finish before weight version {version} (pipeline.partial_rollout=false)"
        try:
            route.on_engines(lambda e, engine: engine.close_for_update.remote(), range(len(route.engines)), what)
        except ActorDiedError as e:  # (the push's failure path finds the lost engines)
            raise WeightSyncError(one_line(e)) from e
        return time.perf_counter() - t

    def route(self, step: int | None = None) -> Route:
        """Per shard, every actor that stages it: its policy rank, and the critic, reference and
        reward-model ranks when the algorithm and the reward have them. `step`: the step whose
        rollout the engines make (a replacement engine is seeded for it)."""
        n = len(self.actors.policy)
        # (empty when not planned; a reference hosted by the policy ranks reads their staged shards)
        roles = [self.actors.critic, self.actors.own_reference, self.actors.reward]
        per_role = [rank_per_shard(ranks, n) for ranks in roles]
        consumers = [[rank, *(r[i] for r in per_role if r[i] is not None)] for i, rank in enumerate(self.actors.policy)]
        return Route(
            engines=list(self.actors.engines),
            consumers=consumers,
            get=self._get,
            fleet=None if step is None else self,
            step=step,
            timeout_s=self.settings.step_timeout_s,
        )

    def hand_over(self, held: HeldRollout) -> Delivery:
        """Stage a held rollout on the trainers. Its shares lost with an engine (replaced since
        they were made, or found dead by the hand-over itself) are drawn again on the replacement
        first, where the pipeline allows it (`redraw_lost_shares`)."""
        return self._with_lost_shares_redrawn(held, lambda route: self.transfer.hand_over(held, route))

    def export_held(self, held: HeldRollout) -> HeldRollout:
        """A held rollout with its samples, for a checkpoint (lost shares drawn again first)."""
        return self._with_lost_shares_redrawn(held, lambda route: self.transfer.export_held(held, route))

    def _with_lost_shares_redrawn(self, held: HeldRollout, action: Callable[[Route], Any]) -> Any:
        """`action(route)` on the engines that hold every share of `held`. An engine found dead by
        it is replaced (fault.max_engine_restarts), its share drawn again, and the action repeated
        -- where the pipeline redraws lost shares; elsewhere the failure stands (a lost process)."""
        while True:
            route = self.route()
            self.redraw_lost_shares(held, route)
            try:
                return action(route)
            except (ActorDiedError, StepFailedError, ActorTimeoutError):
                if not self.pipeline.redraws_lost_shares:
                    raise
                if any(engine is not now for engine, now in zip(route.engines, self.actors.engines)):
                    continue  # (a rollout thread replaced an engine meanwhile: its shares are drawn again first)
                dead = self._lost_engines()
                if not dead:
                    raise
                for e, engine in dead:
                    self._replace_engine(e, held.step, dead=engine)

    def _lost_engines(self) -> list[tuple[int, Any]]:
        """(index, handle) of the engines that are dead or hung (an engine busy in a long call that
        makes engine steps is neither: `lost_processes`)."""
        engines = list(self.actors.engines)
        return [(e, engines[e]) for e in lost_processes(engines, timeout_s=PROBE_TIMEOUT_S)]

    def redraw_lost_shares(self, held: HeldRollout, route: Route) -> None:
        """Before a held rollout is handed over (or read into a checkpoint): every engine process
        that made a share of it still holds it. One replaced since (lost while generating another
        rollout, receiving weights, or found dead holding this one) took its share along: under a
        pipeline that redraws lost shares (async) the share is drawn again on the replacement --
        the same prompts, new samples, the replacement's weights -- or, for a rollout restored from
        a checkpoint, held again from the checkpoint's samples; elsewhere it is a lost process
        (EngineDiedError) and the run restarts from its checkpoint, which repeats the
        uninterrupted run bit for bit."""
        if not held.shares:
            return
        lost = [e for e, shares in enumerate(held.shares) if any(s.engine is not route.engines[e] for s in shares)]
        if not lost:
            return
        several = len(lost) > 1
        what = f"vLLM engine{'s' if several else ''} {', '.join(map(str, lost))}"
        if not self.pipeline.redraws_lost_shares or (held.request is None and held.samples is None):
            raise EngineDiedError(
                f"{what} lost after making {'their shares' if several else 'its share'} of step {held.step}'s rollout "
                "(replaced since): the share went with it"
            )
        t = time.perf_counter()
        route.fleet, route.step = self, held.step
        redrawn = 0
        while lost:  # (an engine lost during the redraw takes the shares it kept: drawn again in turn)
            redrawn += self.transfer.redraw(held, route, lost)
            lost = [e for e, shares in enumerate(held.shares) if any(s.engine is not route.engines[e] for s in shares)]
        held.ready_at = time.time()  # (ready again now: what it waited for the trainers counts from here)
        took = time.perf_counter() - t
        self._restart_s[held.step] = self._restart_s.get(held.step, 0.0) + took
        self._redrawn[held.step] = self._redrawn.get(held.step, 0) + redrawn
        print(
            f"{what}: {'their shares' if several else 'its share'} of step {held.step}'s rollout, lost with "
            f"{'them' if several else 'it'}, {'held again' if held.samples is not None else 'drawn again'} on the "
            f"replacement ({took:.1f}s)",
            flush=True,
        )

    def replace(self, e: int, step: int, dead: Any = None) -> Any:
        """Engine `e` lost making step `step`'s rollout: its replacement (`Route.replace`)."""
        return self._replace_engine(e, step, dead)

    def _replace_engine(self, e: int, step: int, dead: Any = None) -> Any:
        """Engine `e` (the handle `dead`) died making step `step`'s rollout: a new one in its
        bundle, the weight groups re-formed with it, the trainers' weights pushed, its sampling
        seeded for that step. Bounded by the budget. Several rollouts in flight on it
        (pipeline=async) each ask: the first replaces it, the others get the replacement."""
        if self.closing:
            raise EngineDiedError(f"vLLM engine {e} stopped while the run was ending")
        with self._replacing:
            if dead is not None and self.actors.engines[e] is not dead:
                return self.actors.engines[e]
            if self.pipeline.holds_finished_rollouts() and not self.pipeline.redraws_lost_shares:
                # Its share of a rollout finished for a later step went with it: the run restarts
                # from its last checkpoint instead (ActorDiedError is a lost process). Under async
                # the share is drawn again before that rollout's hand-over (redraw_lost_shares).
                raise EngineDiedError(f"vLLM engine {e} died holding rollouts finished ahead for later steps")
            return self._replace_dead_engine(e, step, dead)

    def _replace_dead_engine(self, e: int, step: int, dead: Any = None) -> Any:
        s = self.settings
        t = time.perf_counter()
        # During a one-step-off overlap the trainers may be training: wait, so the replacement
        # (and every other engine, the group being re-formed) gets whole, labelled weights.
        with self._training, self._pushing:
            if dead is not None and self.actors.engines[e] is not dead:
                # (replaced meanwhile by the main thread's weight push, which found it dead)
                return self.actors.engines[e]
            if self.trained != self.version and self.pipeline.one_version_per_rollout:
                # one_step_off: the rollout was drawn with the engines' version while the trainers
                # made the next one; that version is gone from the trainers, and a share drawn with
                # newer weights would not be the run's. The checkpoint carried the rollout ahead:
                # a restart from it repeats the uninterrupted run (ActorDiedError is a lost process).
                raise EngineDiedError(
                    f"vLLM engine {e} died making step {step}'s rollout while the trainers updated: the weights it drew with "
                    f"(v{self.version}) are gone from the trainers (now v{self.trained}), so a replacement would draw its "
                    "share with other weights than the rest of the rollout"
                )
            self._charge_restarts([e], step, f"died during step {step}")
            self._wire_replacements([e], self.trained, step)
            engine = self.actors.engines[e]
        self._get(
            [engine.reseed.remote(engine_seed(s.seed, step, e))], "seeding the replacement engine", engine_call=True
        )
        took = time.perf_counter() - t
        self._restart_s[step] = self._restart_s.get(step, 0.0) + took
        print(
            f"engine {e} died making step {step}'s rollout: replaced in its bundle, weights v{self.version} pushed, "
            f"its prompts re-issued ({took:.1f}s; restart {self.engine_restarts_used}/{s.max_engine_restarts})",
            flush=True,
        )
        return engine

    def _replace_after_sync(self, dead: list[int], stuck: list[int], version: int, before: bool = False) -> None:
        """Engines lost while receiving weights: new ones in their bundles, every weight group
        re-formed, the same version pushed again. The budget (fault.max_engine_restarts) counts the
        dead: engines left alive but stuck in the broadcast a dead one broke are its collateral,
        replaced with it at no charge (they count only when none died: a hung broadcast). `before`:
        found dead as the push began (it died since its last call). The next rollout seeds every
        engine for its step, so it draws what it would have."""
        s = self.settings
        lost = sorted(dead + stuck)
        counted = dead or stuck
        if self.pipeline.holds_rollout() and not self.pipeline.redraws_lost_shares:
            # Its share of the rollout generated ahead went with it: the run restarts from its
            # last checkpoint instead (ActorDiedError is a lost process). Under async it is drawn
            # again before its hand-over, and a generation in flight on it goes on on the replacement.
            raise EngineDiedError(
                f"vLLM engine{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost {'before ' if before else ''}receiving "
                f"weight version {version} while the rollout generated ahead for the next step was held"
            )
        t = time.perf_counter()
        self._charge_restarts(
            counted, self.trained, f"lost {'before ' if before else ''}receiving weight version {version}"
        )
        self._wire_replacements(lost, version, self.trained)
        took = time.perf_counter() - t
        self._restart_s[self.trained] = self._restart_s.get(self.trained, 0.0) + took
        collateral = (
            f" (engine{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} stuck in the broken broadcast)"
            if dead and stuck
            else ""
        )
        print(
            f"engine{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost {'before ' if before else ''}receiving weight version {version}{collateral}: "
            f"replaced in {'their bundles' if len(lost) > 1 else 'its bundle'}, the version pushed again "
            f"({took:.1f}s; restart {self.engine_restarts_used}/{s.max_engine_restarts})",
            flush=True,
        )

    def _refuse_if_a_sender_died(self, version: int) -> None:
        """A push that failed because a policy rank (a sender) died leaves the engines stuck in the
        broken group: replacing them would fail again against the dead rank, charge each round to
        the engine budget and end the run. A lost trainer is a lost process (every role restarts
        from the checkpoint) -- asked first."""
        dead = dead_actors(self.actors.policy, timeout_s=PROBE_TIMEOUT_S)
        if dead:
            raise ActorDiedError(f"policy rank {dead[0]} died pushing weight version {version} to the engines")

    def _charge_restarts(self, engines: list[int], step: int, what: str) -> None:
        """Count replacements of `engines` against fault.max_engine_restarts (logged under `step`),
        or EngineRestartBudgetError when they do not fit."""
        refusal = engine_restart_refusal(engines, what, self.engine_restarts_used, self.settings.max_engine_restarts)
        if refusal is not None:
            raise EngineRestartBudgetError(refusal)
        self.restart_log.setdefault(step, []).extend([0.0] * len(engines))

    def _wire_replacements(self, replace: list[int], version: int, step: int) -> None:
        """New engines for `replace` in their bundles, every weight group re-formed and `version`
        pushed. An engine lost meanwhile -- a new one included, before it was ever used -- is
        replaced in its turn (the dead charged to the budget, those stuck in the broken group with
        them for free), so one fault never strands the others in a half-formed group."""
        s = self.settings
        while True:
            for e in replace:
                self.actors.restart_engine(e)
            try:
                self.sync.prepare(self.actors.policy, self.actors.engines, s.engine_tp)
                self._let_requests_finish(version)
                self.last_sync = self.sync.push(version)
                self.sync.verify(version)
                self.version = version
                return
            except WeightSyncError:
                self._refuse_if_a_sender_died(version)
                dead, stuck = dead_or_stuck(self.actors.engines, timeout_s=PROBE_TIMEOUT_S)
                if not dead and not stuck:
                    raise
                self._charge_restarts(
                    dead or stuck, step, f"lost while the weight groups were formed again for version {version}"
                )
                replace = sorted(dead + stuck)
                print(
                    f"engine{'s' if len(replace) > 1 else ''} {', '.join(map(str, replace))} lost while the weight groups were "
                    "formed again: replaced in turn",
                    flush=True,
                )
