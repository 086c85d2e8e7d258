"""How the train loop survives the loss of a vLLM engine, mixed into `TrainLoop`: a dead engine is
replaced in its bundle (bounded by fault.max_engine_restarts), the weight groups are formed again
around it and the trainers' weights pushed; the shares of held rollouts it took along are drawn
again on the replacement where the pipeline allows it (async), or the loss is a lost process that
restarts the run from its checkpoint (sync, one_step_off: that repeats the uninterrupted run).

Who finds an engine dead: a rollout thread whose call failed (`Route.on_engines` ->
`_replace_engine`), a weight push (`TrainLoop._push` -> `_replace_after_sync`), a hand-over or a
checkpoint's read of a held rollout (`_with_lost_shares_redrawn`). One replacement at a time, never
during a push or while the trainers update (their locks), and a second finder of the same death takes
the replacement the first made.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from rlhf_orch.orchestration.actors import PROBE_TIMEOUT_S, dead_actors, dead_or_stuck, lost_processes
from rlhf_orch.orchestration.checkpoint import engine_seed
from rlhf_orch.orchestration.restart_decision import engine_restart_refusal
from rlhf_orch.orchestration.errors import ActorDiedError, ActorTimeoutError, EngineDiedError, EngineRestartBudgetError, StepFailedError
from rlhf_orch.sync.base import WeightSyncError
from rlhf_orch.transfer.base import Delivery, HeldRollout, Route


class EngineRecovery:
    """The engine-loss half of `TrainLoop` (its state: actors, sync, pipeline, settings, transfer,
    versions, the restart log and the locks are the loop's)."""

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
        route.replace_engine = functools.partial(self._replace_engine, step=held.step)
        redrawn = 0
        while lost:  # (an engine lost during the redraw takes the shares it kept: drawn again in turn)
            redrawn += self.transfer.redraw(held, route, lost)
            lost = [e for e, shares in enumerate(held.shares) if any(s.engine is not route.engines[e] for s in shares)]
        held.ready_at = time.time()  # (ready again now: what it waited for the trainers counts from here)
        took = time.perf_counter() - t
        self._restart_s[held.step] = self._restart_s.get(held.step, 0.0) + took
        self._redrawn[held.step] = self._redrawn.get(held.step, 0) + redrawn
        print(f"{what}: {'their shares' if several else 'its share'} of step {held.step}'s rollout, lost with "
              f"{'them' if several else 'it'}, {'held again' if held.samples is not None else 'drawn again'} on the "
              f"replacement ({took:.1f}s)", flush=True)

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
        self._get([engine.reseed.remote(engine_seed(s.seed, step, e))], "seeding the replacement engine", engine_call=True)
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
        self._charge_restarts(counted, self.trained, f"lost {'before ' if before else ''}receiving weight version {version}")
        self._wire_replacements(lost, version, self.trained)
        took = time.perf_counter() - t
        self._restart_s[self.trained] = self._restart_s.get(self.trained, 0.0) + took
        collateral = f" (engine{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} stuck in the broken broadcast)" if dead and stuck else ""
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
                self._charge_restarts(dead or stuck, step, f"lost while the weight groups were formed again for version {version}")
                replace = sorted(dead + stuck)
                print(f"engine{'s' if len(replace) > 1 else ''} {', '.join(map(str, replace))} lost while the weight groups were "
                      "formed again: replaced in turn", flush=True)
