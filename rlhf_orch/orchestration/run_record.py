"""What a run keeps on disk as it goes: metrics (metrics.jsonl and the step logger), checkpoints and,
at the end, summary.json. The driver-side record of one run; `session.run_training` owns one."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from rlhf_orch.checkpoint_dirs import CheckpointStore, run_checkpoint_root
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.one_line import named
from rlhf_orch.orchestration.checkpoint import ResumePoint, load_resume, save_checkpoint
from rlhf_orch.rng import rng_state, set_rng_state


class ForeignCheckpointError(RuntimeError):
    """The checkpoint a restart would load was written by another run (a shared checkpoint.dir)."""


class RunRecord:
    """Metrics so far (a resumed run's included), where checkpoints go and which was last."""

    def __init__(
        self,
        run_dir: Path,
        typed: RootConfig,
        config_dict: dict,
        logger: Any,
        task: Any,
        resume: ResumePoint | None,
        zero_stages: dict[str, int] | None = None,
    ):
        ck = typed.checkpoint
        self.run_dir, self.typed, self.config_dict, self.logger, self.task = run_dir, typed, config_dict, logger, task
        # The ZeRO stage each trained role runs (its TrainerSpec's), written with every checkpoint:
        # the stage a resumed run must load it at.
        self.zero_stages = dict(zero_stages or {})
        # Under a shared checkpoint.dir, this run's own directory: other runs' saves and rotations never touch it.
        self.store = CheckpointStore(run_checkpoint_root(run_dir, ck.dir), ck.keep_last)
        if resume is not None:
            for moved in self.store.set_aside_after(resume.step):
                print(
                    f"resume: {moved.name.rsplit('-', 1)[0]} is of a timeline this run goes back past: kept in {moved.parent}",
                    flush=True,
                )
        self.history: list[dict[str, Any]] = list(resume.state["metrics"]) if resume else []
        self.last_checkpoint: Path | None = resume.info.path if resume else None
        self._resumed_from: Path | None = resume.info.path if resume else None
        self.last_checkpoint_step: int | None = resume.step if resume else None
        self._last_checkpoint_at = time.monotonic()
        self._finished: dict[str, Any] | None = None
        self._initial: dict[str, Any] | None = None  # the driver's state before step 1 (a fresh run)
        self.trainer_restarts = int(resume.state.get("trainer_restarts", 0)) if resume else 0
        # The fault budgets are this invocation's (a resumed run -- by hand, or a requeued job --
        # starts with them whole); the counters logged stay the run's.
        self.trainer_restarts_at_start = self.trainer_restarts
        self.engine_restarts_at_start = int(resume.state.get("engine_restarts", 0)) if resume else 0
        # Every engine replacement of the run, by the step whose rollout lost it (None: none yet in
        # this process): a whole-run restart carries it into the new attempt, so the counters stay
        # run-wide and fault.max_engine_restarts this invocation's (the checkpoint's log knows only
        # the steps before it).
        self.engine_restart_log: dict[int, list[float]] | None = None
        # (resume=run_dir with no checkpoint yet: a fresh start over an earlier attempt's records)
        self.metrics_file = MetricsFile(
            run_dir, keep_through_step=resume.step if resume else (-1 if typed.resume else None)
        )
        logger.start(
            str(run_dir),
            config_dict,
            typed.experiment_name,
            resume_id=resume.state.get("logger_run_id") if resume else None,
        )

    @property
    def trainer_restarts_used(self) -> int:
        """Whole-run restarts this invocation made (what fault.max_trainer_restarts bounds)."""
        return self.trainer_restarts - self.trainer_restarts_at_start

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics_file.write(metrics)
        self.logger.log(step, metrics)
        self.history.append(metrics)
        every = self.typed.logger.plot_every_n_steps
        if every and step > 0 and step % every == 0:
            self.write_report()

    def write_report(self) -> None:
        """logger.report: <run dir>/report.html (`rlhf_orch.view`) from what the run dir holds now;
        a failure is one printed line, never a failed run."""
        if not self.typed.logger.report:
            return
        try:
            from rlhf_orch.view.page import write_report

            write_report([self.run_dir])
        except Exception as e:  # the page must never fail the run
            print(f"report: not written ({type(e).__name__}: {e})", flush=True)

    def step_finished(self, step: int, loop: Any) -> None:
        """The driver's state after finished step `step` (counters, the sampler's position, RNG
        states: small): what a final checkpoint of a failed run goes back to. It carries no
        rollout generated ahead, so the sampler goes back to before their prompts were drawn: a
        resumed run draws them again (none is skipped)."""
        self._finished = self._driver_state(step, loop, data=loop.data_state_before(step + 1))

    def _driver_state(self, step: int, loop: Any, data: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "step": step,
            "weight_version": loop.version,
            "trained_version": loop.trained,
            "engine_restarts": loop.engine_restarts,
            "restart_log": copy.deepcopy(loop.restart_log),
            "data": data if data is not None else self.task.state_dict(),
            "rng": rng_state(),
            "trainer_restarts": self.trainer_restarts,
        }

    def due(self, step: int, last_step: bool, stop_requested: bool) -> bool:
        """A checkpoint after step `step`: every_n_steps, every_n_minutes since the last one (or
        the start), the end of the run, a stop signal."""
        ck = self.typed.checkpoint
        periodic = bool(ck.every_n_steps) and step % ck.every_n_steps == 0
        timed = bool(ck.every_n_minutes) and time.monotonic() - self._last_checkpoint_at >= 60.0 * ck.every_n_minutes
        return periodic or timed or (last_step and ck.at_end) or (stop_requested and ck.on_signal)

    def checkpoint(self, step: int, loop: Any, actors: Any) -> None:
        """Every trainer's DeepSpeed state and the driver's: data position, RNG, metrics, a rollout
        generated ahead (one_step_off), engine restarts -- what exact resume needs."""
        # The rollouts in flight first: settling them may draw more prompts (dynamic sampling's
        # extra rounds), and the sampler's position saved must be the one after every draw they made.
        pending = loop.pipeline.pending(loop)
        # Where the sampler was before each carried rollout's prompts: a resumed run with a lower
        # pipeline.max_staleness draws those it may not train again (checkpoint._within_the_staleness_bound).
        carried = pending if isinstance(pending, list) else [pending] if pending is not None else []
        before = {h.step: loop.data_state_before(h.step) for h in carried}
        self._write(
            step,
            loop,
            actors,
            {**self._driver_state(step, loop), "pending_rollout": pending, "data_before_pending": before},
        )

    def final_checkpoint(self, loop: Any, actors: Any, exact_only: bool = False) -> str:
        """After a failure, while the trainers may still be alive: a checkpoint of the last
        finished step, unless one exists or the trainers have moved past it (or, `exact_only`: a
        restart follows, which must repeat the uninterrupted run, and this one would not resume
        bit for bit). One line on what was done (empty when there was nothing to do)."""
        finished = self._finished
        if finished is None or loop is None:
            return ""
        step = finished["step"]
        if self.last_checkpoint_step == step:
            return ""
        if loop.updating:
            return (
                f"no final checkpoint: the failure came while the trainers were updating after step {step} (one role "
                "may have applied the update, another not; the last checkpoint is the newest consistent state)"
            )
        if loop.trained != finished["trained_version"]:
            return (
                f"no final checkpoint: the trainers had already updated past step {step} "
                "(the last checkpoint is the newest consistent state)"
            )
        # A rollout generated ahead (one_step_off) is gone with the failure: the resumed run makes
        # step k+1's again, with the newer weights -- close to, not bit for bit, the uninterrupted run.
        exact = not loop.pipeline.needs_held_rollouts
        if exact_only and not exact:
            return ""
        try:
            self._write(step, loop, actors, {**finished, "pending_rollout": None, "final": True, "exact": exact})
        except Exception as e:  # the run has failed already; say why nothing was kept
            return f"no final checkpoint: {named(e)}"
        return (
            "" if exact else "final checkpoint: its resumed run re-generates the next step's rollout (not bit for bit)"
        )

    def _write(self, step: int, loop: Any, actors: Any, driver: dict[str, Any]) -> None:
        t = time.perf_counter()
        state = {
            **driver,
            # Plain floats (driver.pt loads as data only), through this step (a final checkpoint
            # goes back to the last finished step).
            "metrics": json.loads(json.dumps([m for m in self.history if m.get("step", 0) <= step])),
            "logger_run_id": getattr(self.logger, "run_id", None),
            "config": self.config_dict,
            "zero_stages": dict(self.zero_stages),  # (checkpoint.checkpoint_zero_stages)
        }
        manifest = {
            "weight_version": driver["weight_version"],
            "run_dir": str(self.run_dir.resolve()),
            "experiment_name": self.typed.experiment_name,
        }
        ck = self.typed.checkpoint
        self.last_checkpoint = save_checkpoint(
            self.store, step, actors, loop._get, state, ck.export_hf, manifest, ck.timeout_s
        )
        self.last_checkpoint_step = step
        self._last_checkpoint_at = time.monotonic()
        print(f"checkpoint: step {step} -> {self.last_checkpoint} ({time.perf_counter() - t:.1f}s)", flush=True)

    def started(self, loop: Any) -> None:
        """Training begins (again, after a restart): the time-based checkpoint interval counts from
        here; a fresh run notes the driver's state to go back to before any checkpoint exists."""
        self._last_checkpoint_at = time.monotonic()
        if self._initial is None and self.last_checkpoint is None:
            self._initial = self._driver_state(0, loop)

    def last_finished_step(self) -> int:
        """The last step this attempt finished (before its first: where it started from)."""
        if self._finished is not None:
            return self._finished["step"]
        return self.last_checkpoint_step or 0

    def attempt_failed(self, loop: Any) -> None:
        """An attempt ended in a failure: keep its engine replacements for the next attempt."""
        if loop is not None:  # (a rollout thread may still be adding to it: copied item by item, atomically)
            self.engine_restart_log = {step: list(times) for step, times in list(loop.restart_log.items())}

    def restart_point(self, num_steps: int) -> ResumePoint | None:
        """After a lost process: where the run starts again -- the last checkpoint (its driver
        state put back), or with none the state before step 1 (None: the initial weights). The
        metrics of later steps are dropped; the re-run steps log them again."""
        self.trainer_restarts += 1
        if self.last_checkpoint is None:
            self.task.load_state_dict(self._initial["data"])
            set_rng_state(self._initial["rng"])
            self._rewind(0)
            return None
        ck = self.typed.checkpoint
        resume = load_resume(
            str(self.last_checkpoint),
            self.run_dir.parent,
            ck.dir,
            self.config_dict,
            num_steps,
            self.typed.experiment_name,
        )
        if not self._own(resume.info.path):  # never train on another run's weights
            raise ForeignCheckpointError(
                f"the checkpoint {resume.info.path} to restart from is neither this run's (under {self.store.root}) nor the one "
                f"it resumed from ({self._resumed_from}); it was written by {resume.info.manifest.get('run_dir')}"
            )
        self.task.load_state_dict(resume.state["data"])
        set_rng_state(resume.state["rng"])
        self._rewind(resume.step)
        return resume

    def _own(self, checkpoint: Path) -> bool:
        """A checkpoint this run may restart from: one it wrote (in its own store) or the one it
        was resumed from (which may be another run dir's: a sweep job, a moved run dir)."""
        path = Path(checkpoint).resolve()
        return path.parent == self.store.root.resolve() or (
            self._resumed_from is not None and path == self._resumed_from.resolve()
        )

    def _rewind(self, step: int) -> None:
        self.history = [m for m in self.history if m.get("step", 0) <= step]
        self.metrics_file.close()
        self.metrics_file = MetricsFile(self.run_dir, keep_through_step=step)
        self._finished = None

    def resume_hint(self) -> str:
        return resume_hint(self.last_checkpoint)

    def close(self, outcome: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """Flush the metrics, end the logger's run and write summary.json (which it returns)."""
        self.metrics_file.close()
        self.logger.close(
            exit_code=0 if outcome["status"] == "completed" else 1,
            preempted=outcome["status"] in ("interrupted", "aborted"),
        )
        summary = run_summary(self.run_dir, self.history, wall_s, outcome, self.last_checkpoint)
        summary["trainer_restarts"] = self.trainer_restarts
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.write_report()  # (after summary.json: the page says how the run ended)
        return summary


def resume_command(last_checkpoint: Path | None) -> str | None:
    return f"python run.py resume={last_checkpoint}" if last_checkpoint else None


def resume_hint(last_checkpoint: Path | None) -> str:
    if last_checkpoint is None:
        return "; no checkpoint was written (checkpoint.every_n_steps / checkpoint.every_n_minutes keep progress)"
    return f"; last checkpoint: {last_checkpoint} (continue with: {resume_command(last_checkpoint)})"


def run_summary(
    run_dir: Path, history: list[dict[str, Any]], wall_s: float, outcome: dict[str, Any], last_checkpoint: Path | None
) -> dict[str, Any]:
    """summary.json: how the run ended, first/last rewards and evaluations (resumed steps included)."""
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    evals = [
        {k: v for k, v in m.items() if k == "step" or k.startswith("eval/")}
        for m in history
        if any(k.startswith("eval/") for k in m)
    ]
    k = max(1, min(5, len(rewards) // 3))
    return {
        "run_dir": str(run_dir),
        **outcome,
        "steps": max((m["step"] for m in history), default=0),
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "last_checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "resume_command": resume_command(last_checkpoint) if outcome.get("status") != "completed" else None,
        "wall_s": wall_s,
    }
