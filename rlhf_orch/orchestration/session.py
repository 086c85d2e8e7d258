"""One training run: prepare the inputs (before Ray), start Ray and the role actors, loop, tear down."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.engines.launch import memory_utilization, sleep_level
from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.orchestration.actors import start_role_actors
from rlhf_orch.orchestration.evaluation import EvalSettings, Evaluator
from rlhf_orch.checkpoint_dirs import CheckpointStore, ResumeError
from rlhf_orch.orchestration.checkpoint import load_resume, restore_trainers, save_checkpoint
from rlhf_orch.orchestration.inputs import InputError, RunInputs, prepare_inputs
from rlhf_orch.orchestration.loop import LoopSettings, TrainLoop, non_finite
from rlhf_orch.orchestration.signals import SignalAbort, StopRequest
from rlhf_orch.rng import rng_state, set_rng_state
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.trainer.workers import TrainerSpec


def trainer_specs(cfg: RootConfig, plan: PlacementPlan, model_path: str, pad_id: int) -> dict[str, TrainerSpec]:
    """Per trainer role, what its processes need (roles the algorithm has no use for get none)."""
    a, t = cfg.algo, cfg.trainer

    def spec(role: str, lr: float) -> TrainerSpec:
        return TrainerSpec(
            model_path=model_path,
            dtype=cfg.model.dtype,
            zero_stage=t.zero_stage,
            micro_batch_size=a.micro_batch_size,
            train_batch_size=a.train_batch_size,
            data_parallel_size=max(len(plan.slots_for(role)), 1),
            pad_id=pad_id,
            temperature=a.temperature,
            lr=lr,
            weight_decay=t.weight_decay,
            grad_clip=a.grad_clip,
            clip_eps=getattr(a, "value_clip_eps", 0.2),  # the critic's value clip (the policy's clips are in algo)
            ppo_epochs=a.ppo_epochs,
            seed=t.seed,
            optimizer=t.optimizer,
        )

    specs = {"actor": spec("actor", a.actor_lr)}
    if a.needs_critic:
        specs["critic"] = spec("critic", a.critic_lr)
    if a.needs_reference:
        specs["reference"] = spec("reference", 0.0)
    return specs


def eval_settings(cfg: RootConfig) -> EvalSettings:
    e = cfg.eval
    return EvalSettings(
        every_n_steps=e.every_n_steps,
        before_train=e.before_train,
        samples_per_prompt=e.samples_per_prompt,
        temperature=e.temperature,
        pass_threshold=e.pass_threshold,
        max_tokens=cfg.data.response_max_len,
    )


class NonFiniteError(RuntimeError):
    """A loss, reward, advantage or gradient norm became NaN or infinite."""


class RunFailed(RuntimeError):
    """Training stopped on a runtime failure; the message names the cause and how to resume."""


def run_training(
    cfg: DictConfig,
    typed: RootConfig,
    plan: PlacementPlan,
    launcher: Any,
    run_dir: Path,
    callbacks: Sequence[Callable[[int, TrainLoop], None]] = (),
) -> dict[str, Any]:
    """Train; `callbacks(step, loop)` run after each finished (logged, checkpointed) step.

    Everything that can be checked without Ray (the model, the data, the reward, the checkpoint to
    resume) is prepared first: `prepare_inputs` raises `InputError`, `load_resume` `ResumeError`
    (exit 2) before any actor starts. The summary's `status` is "completed", or "interrupted"
    (a stop signal: `signal` names it) -- the app turns that into exit 128 + signal.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    inputs: RunInputs = prepare_inputs(cfg, typed)
    tokenizer, task, reward = inputs.tokenizer, inputs.task, inputs.reward
    a, ck = typed.algo, typed.checkpoint
    store = CheckpointStore(Path(ck.dir) if ck.dir else run_dir / "checkpoints", ck.keep_last)
    resume = None
    if typed.resume:
        resume = load_resume(typed.resume, run_dir.parent, ck.dir, config_dict, a.num_steps, typed.experiment_name)
        task.load_state_dict(resume.state["data"])
        set_rng_state(resume.state["rng"])
    transfer = instantiate(cfg.transfer)
    sync = instantiate(cfg.sync)
    sync.use_plan(plan)  # CUDA IPC: which policy rank feeds which engine worker
    pipeline = instantiate(cfg.pipeline)
    logger = instantiate(cfg.logger)
    history: list[dict[str, Any]] = list(resume.state["metrics"]) if resume else []
    metrics_file = MetricsFile(run_dir, keep_through_step=resume.step if resume else None)
    logger.start(str(run_dir), config_dict, typed.experiment_name, resume_id=resume.state.get("logger_run_id") if resume else None)
    for line in inputs.notes:
        print(line, flush=True)
    if resume:
        which = f" (resume=auto: the newest checkpoint of experiment {typed.experiment_name!r})" if typed.resume == "auto" else ""
        print(f"resuming from step {resume.step}: {resume.info.path}{which}", flush=True)
        if resume.changed:
            print(f"resume: changed since the checkpoint (allowed): {', '.join(resume.changed)}", flush=True)

    specs = trainer_specs(typed, plan, inputs.model_path, tokenizer.pad_token_id)
    reward_spec = None
    if inputs.reward_model_path:
        reward_spec = replace(specs["actor"], lr=0.0, model_path=inputs.reward_model_path, micro_batch_size=reward.model.micro_batch_size)
    engine_spec = EngineSpec(
        model_path=inputs.model_path,
        dtype=typed.model.dtype,
        max_model_len=typed.data.prompt_max_len + typed.data.response_max_len,
        tensor_parallel_size=plan.engine_tp,
        seed=typed.seed,
        kv_cache_gb=typed.engine.kv_cache_gb,
        gpu_memory_utilization=memory_utilization(typed.engine.gpu_memory_utilization, plan),
        sleep_level=sleep_level(typed.engine.sleep_level, plan),
        enable_prefix_caching=typed.engine.enable_prefix_caching,
        enforce_eager=typed.engine.enforce_eager,
    )
    t_start = time.perf_counter()
    stop = StopRequest("stopping after this step" + (", with a checkpoint" if ck.on_signal else ""))
    outcome: dict[str, Any] = {"status": "failed"}
    last_checkpoint: list[Path] = [resume.info.path] if resume else []
    from rlhf_orch.topology.ray_placement import RayPlacement

    def log(step: int, metrics: dict[str, Any]) -> None:
        metrics_file.write(metrics)
        logger.log(step, metrics)
        history.append(metrics)

    def checkpoint(step: int, loop: TrainLoop, actors: Any) -> None:
        t = time.perf_counter()
        pending = loop.pipeline.pending(loop)  # a rollout generated ahead (one_step_off) is kept
        state = {
            "step": step,
            "weight_version": loop.version,
            "trained_version": loop.trained,
            "pending_rollout": pending,
            "engine_restarts": loop.engine_restarts,
            "restart_log": loop.restart_log,
            "data": task.state_dict(),
            "rng": rng_state(),
            "metrics": json.loads(json.dumps(history)),  # plain floats: driver.pt loads as data only
            "logger_run_id": getattr(logger, "run_id", None),
            "config": config_dict,
        }
        manifest = {"weight_version": loop.version, "run_dir": str(run_dir.resolve()), "experiment_name": typed.experiment_name}
        path = save_checkpoint(store, step, actors, loop._get, state, ck.export_hf, manifest, ck.timeout_s)
        last_checkpoint[:] = [path]
        print(f"checkpoint: step {step} -> {path} ({time.perf_counter() - t:.1f}s)", flush=True)

    try:
        # Installed before Ray starts (a signal during start-up stops the run before its first
        # step) and again after ray.init, which sets a SIGTERM handler of its own.
        with stop.installed(), launcher.session(run_dir, typed.logger.verbose), stop.installed(), RayPlacement(
            plan, ready_timeout_s=typed.launcher.startup_timeout_s
        ) as placement:
            actors = start_role_actors(
                plan,
                placement,
                engine_spec,
                specs["actor"],
                specs.get("critic"),
                specs.get("reference"),
                typed.launcher.startup_timeout_s,
                typed.engine.kv_cache_gb,
                reward_spec,
            )
            loop: TrainLoop | None = None
            try:
                sync.prepare(actors.policy, actors.engines, plan.engine_tp)
                loop = TrainLoop(
                    actors,
                    task,
                    tokenizer,
                    transfer,
                    sync,
                    instantiate(cfg.algo),
                    LoopSettings(
                        num_steps=a.num_steps,
                        rollout_batch_size=a.rollout_batch_size,
                        samples_per_prompt=a.samples_per_prompt,
                        micro_batch_size=a.micro_batch_size,
                        response_max_len=typed.data.response_max_len,
                        max_seq_len=typed.data.prompt_max_len + typed.data.response_max_len,
                        temperature=a.temperature,
                        seed=typed.seed,
                        step_timeout_s=typed.fault.step_timeout_s,
                        max_engine_restarts=typed.fault.max_engine_restarts,
                        engine_tp=plan.engine_tp,
                        engines_sleep=engine_spec.sleep_level != 0,
                    ),
                    reward,
                    pipeline,
                )
                if resume:
                    # The trainers' exact state, then the engines get those weights through the
                    # configured sync before the first resumed step; a rollout generated ahead of
                    # the checkpoint goes back onto the engines.
                    restore_trainers(resume.info.path, actors, loop._get, ck.timeout_s)
                    loop.trained = resume.state.get("trained_version", resume.state["weight_version"])
                    loop.version = -1  # fresh engines: push whatever the checkpoint says
                    loop.restart_log = resume.state.get("restart_log") or {0: [0.0] * resume.state["engine_restarts"]}
                    loop.sync_engines({})
                    loop.first_step = resume.step + 1
                    pipeline.restore(loop, resume.state.get("pending_rollout"))
                first_step = loop.first_step
                evaluator = Evaluator(eval_settings(typed), inputs.eval_prompts, reward, loop._get)
                startup_s = time.perf_counter() - t_start

                def evaluate(step: int) -> dict[str, float]:
                    if not evaluator.should_run(step):
                        return {}
                    # The engines must be idle and hold the trainers' newest weights; a rollout
                    # they hold for the next step is parked here while the evaluation uses them.
                    held = pipeline.pending(loop) if evaluator.uses_engine_buffers else pipeline.settle(loop)
                    try:
                        return evaluator.run(actors.engines, actors.reward)
                    finally:
                        if evaluator.uses_engine_buffers and held is not None:
                            pipeline.restore(loop, held)

                if not resume and evaluator.should_run(0):
                    log(0, {"step": 0, "weight_version": 0, **evaluate(0)})
                for step in range(first_step, a.num_steps + 1):
                    if stop.requested:  # arrived before this step started (during start-up or a callback)
                        break
                    metrics = loop.step(step)
                    bad = non_finite(metrics)
                    if bad:  # not logged, not checkpointed: the last good checkpoint stays the latest
                        raise NonFiniteError(f"step {step}: {', '.join(bad)}")
                    metrics.update(evaluate(step))
                    metrics["time/elapsed"] = time.perf_counter() - t_start
                    metrics["time/startup"] = startup_s
                    log(step, metrics)
                    periodic = ck.every_n_steps and step % ck.every_n_steps == 0
                    if periodic or (step == a.num_steps and ck.at_end) or (stop.requested and ck.on_signal):
                        checkpoint(step, loop, actors)
                    for callback in callbacks:
                        callback(step, loop)
                if ck.export_final:
                    export_dir = run_dir / "policy_hf"
                    loop._get([rank.export_hf.remote(str(export_dir)) for rank in actors.policy], "exporting the policy",
                              timeout=(ck.timeout_s, "checkpoint.timeout_s"))
                    print(f"policy exported (Hugging Face format): {export_dir}", flush=True)
                outcome = {"status": "interrupted", "signal": stop.name} if stop.requested else {"status": "completed"}
            finally:
                pipeline.close(loop)
                actors.kill()
    except SignalAbort as e:
        outcome = {"status": "aborted", "signal": e.name}
        raise
    except Exception as e:
        outcome = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        if isinstance(e, (InputError, ResumeError)):
            raise
        raise RunFailed(f"{type(e).__name__}: {e}{resume_hint(last_checkpoint)}") from e
    finally:
        metrics_file.close()
        logger.close(exit_code=0 if outcome["status"] == "completed" else 1, preempted=outcome["status"] in ("interrupted", "aborted"))
        summary = run_summary(run_dir, history, time.perf_counter() - t_start, outcome, last_checkpoint)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def resume_hint(last_checkpoint: list[Path]) -> str:
    if not last_checkpoint:
        return "; no checkpoint was written (set checkpoint.every_n_steps to keep progress)"
    return f"; last checkpoint: {last_checkpoint[0]} (continue with: python run.py resume={last_checkpoint[0]})"


def run_summary(
    run_dir: Path, history: list[dict[str, Any]], wall_s: float, outcome: dict[str, Any], last_checkpoint: list[Path]
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
        "last_checkpoint": str(last_checkpoint[0]) if last_checkpoint else None,
        "wall_s": wall_s,
    }
