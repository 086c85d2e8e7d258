"""What a run keeps on disk as it goes: metrics (metrics.jsonl and the step logger), checkpoints and,
at the end, summary.json. The driver-side record of one run; `session.run_training` owns one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlhf_orch.checkpoint_dirs import CheckpointStore
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.orchestration.checkpoint import ResumePoint, save_checkpoint
from rlhf_orch.rng import rng_state


class RunRecord:
    """Metrics so far (a resumed run's included), where checkpoints go and which was last."""

    def __init__(self, run_dir: Path, typed: RootConfig, config_dict: dict, logger: Any, task: Any, resume: ResumePoint | None):
        ck = typed.checkpoint
        self.run_dir, self.typed, self.config_dict, self.logger, self.task = run_dir, typed, config_dict, logger, task
        self.store = CheckpointStore(Path(ck.dir) if ck.dir else run_dir / "checkpoints", ck.keep_last)
        self.history: list[dict[str, Any]] = list(resume.state["metrics"]) if resume else []
        self.last_checkpoint: Path | None = resume.info.path if resume else None
        self.metrics_file = MetricsFile(run_dir, keep_through_step=resume.step if resume else None)
        logger.start(str(run_dir), config_dict, typed.experiment_name, resume_id=resume.state.get("logger_run_id") if resume else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics_file.write(metrics)
        self.logger.log(step, metrics)
        self.history.append(metrics)

    def checkpoint(self, step: int, loop: Any, actors: Any) -> None:
        """Every trainer's DeepSpeed state and the driver's: data position, RNG, metrics, a rollout
        generated ahead (one_step_off), engine restarts -- what exact resume needs."""
        t = time.perf_counter()
        state = {
            "step": step,
            "weight_version": loop.version,
            "trained_version": loop.trained,
            "pending_rollout": loop.pipeline.pending(loop),
            "engine_restarts": loop.engine_restarts,
            "restart_log": loop.restart_log,
            "data": self.task.state_dict(),
            "rng": rng_state(),
            "metrics": json.loads(json.dumps(self.history)),  # plain floats: driver.pt loads as data only
            "logger_run_id": getattr(self.logger, "run_id", None),
            "config": self.config_dict,
        }
        manifest = {"weight_version": loop.version, "run_dir": str(self.run_dir.resolve()), "experiment_name": self.typed.experiment_name}
        ck = self.typed.checkpoint
        self.last_checkpoint = save_checkpoint(self.store, step, actors, loop._get, state, ck.export_hf, manifest, ck.timeout_s)
        print(f"checkpoint: step {step} -> {self.last_checkpoint} ({time.perf_counter() - t:.1f}s)", flush=True)

    def resume_hint(self) -> str:
        return resume_hint(self.last_checkpoint)

    def close(self, outcome: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """Flush the metrics, end the logger's run and write summary.json (which it returns)."""
        self.metrics_file.close()
        self.logger.close(exit_code=0 if outcome["status"] == "completed" else 1, preempted=outcome["status"] in ("interrupted", "aborted"))
        summary = run_summary(self.run_dir, self.history, wall_s, outcome, self.last_checkpoint)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def resume_hint(last_checkpoint: Path | None) -> str:
    if last_checkpoint is None:
        return "; no checkpoint was written (set checkpoint.every_n_steps to keep progress)"
    return f"; last checkpoint: {last_checkpoint} (continue with: python run.py resume={last_checkpoint})"


def run_summary(
    run_dir: Path, history: list[dict[str, Any]], wall_s: float, outcome: dict[str, Any], last_checkpoint: Path | None
) -> dict[str, Any]:
    """summary.json: how the run ended, first/last rewards and evaluations (resumed steps included)."""
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    evals = [{k: v for k, v in m.items() if k == "step" or k.startswith("eval/")} for m in history if any(k.startswith("eval/") for k in m)]
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
        "wall_s": wall_s,
    }
