"""One training run: prepare the inputs (before Ray), start Ray and the role actors, loop, tear down."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.engines.launch import memory_utilization, sleep_level
from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.logging.rollout_dump import RolloutDump
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.one_line import named
from rlhf_orch.orchestration import warm_actors
from rlhf_orch.orchestration.actors import (
    PROBE_TIMEOUT_S,
    ActorStartError,
    RoleActors,
    StartupStopped,
    lost_processes,
    start_role_actors,
)
from rlhf_orch.orchestration.evaluation import EvalSettings, Evaluator
from rlhf_orch.checkpoint_dirs import OWN_RUN_DIR, ResumeError, find_checkpoint
from rlhf_orch.orchestration.checkpoint import (
    ResumePoint,
    checkpoint_zero_stages,
    export_policy,
    load_resume,
    restore_trainers,
)
from rlhf_orch.orchestration.inputs import InputError, RunInputs, prepare_inputs
from rlhf_orch.orchestration.errors import ActorDiedError, ActorTimeoutError, EngineRestartBudgetError
from rlhf_orch.orchestration.loop import LoopSettings, TrainLoop, non_finite
from rlhf_orch.orchestration.restart_decision import (
    Failure,
    FailurePoint,
    RestartDecision,
    decide_restart,
    failure_signature,
    restart_line,
)
from rlhf_orch.orchestration.run_record import RunRecord
from rlhf_orch.orchestration.signals import SignalAbort, StopRequest
from rlhf_orch.rng import set_rng_state
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.trainer.deepspeed_config import zero_stage_to_run
from rlhf_orch.trainer.spec import TrainerSpec


def trainer_specs(
    cfg: RootConfig,
    plan: PlacementPlan,
    model_path: str,
    pad_id: int,
    lora: LoraSettings | None = None,
    checkpoint_stages: dict[str, int] | None = None,
    teacher_path: str | None = None,
) -> dict[str, TrainerSpec]:
    """Per trainer role, what its processes need (roles the algorithm has no use for get none).
    `lora`: the model option's adapters (model.lora), trained by the policy only. `teacher_path`:
    the teacher's checkpoint (teacher=<model option>), held beside the reference. The ZeRO stage
    each role runs (`zero_stage_to_run`), or where `checkpoint_stages` (the resumed checkpoint's,
    `checkpoint.checkpoint_zero_stages`) names it, the stage its DeepSpeed state was written at."""
    a, t = cfg.algo, cfg.trainer

    def spec(role: str, lr: float) -> TrainerSpec:
        dp = max(len(plan.slots_for(role)), 1)
        stage = zero_stage_to_run(t.zero_stage, dp, t.offload_optimizer)
        return TrainerSpec(
            model_path=model_path,
            dtype=cfg.model.dtype,
            zero_stage=(checkpoint_stages or {}).get(role, stage),
            micro_batch_size=a.micro_batch_size,
            train_batch_size=a.train_batch_size,
            data_parallel_size=dp,
            pad_id=pad_id,
            temperature=a.temperature,
            lr=lr,
            weight_decay=t.weight_decay,
            grad_clip=a.grad_clip,
            clip_eps=getattr(a, "value_clip_eps", 0.2),  # the critic's value clip (the policy's clips are in algo)
            ppo_epochs=a.ppo_epochs,
            seed=t.seed,
            optimizer=t.optimizer,
            offload_optimizer=t.offload_optimizer,
            gradient_checkpointing=t.gradient_checkpointing,
            torch_threads=t.torch_threads,
            reference_memory=t.reference_memory,
            share_prompts=t.share_prompts is not False,  # only packed micro-batches can (validated)
            old_logprobs=t.old_logprobs,
            free_cache_between_phases=plan.shares_gpu(role),
            # (the reference ranks' frozen models; a policy rank reads them when it hosts those ranks)
            holds_reference="ref" in a.frozen_models,
            teacher_path=teacher_path if "teacher" in a.frozen_models else None,
            teacher_dtype=cfg.teacher.dtype if "teacher" in a.frozen_models and cfg.teacher is not None else None,
        )

    # model.lora trains the policy's adapters only; the critic and the reference are full models.
    specs = {"actor": replace(spec("actor", a.actor_lr), lora=lora)}
    if a.needs_critic:
        specs["critic"] = spec("critic", a.critic_lr)
    if a.needs_reference_ranks:
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


def engine_spec(
    typed: RootConfig,
    plan: PlacementPlan,
    model_path: str,
    pipeline: Any = None,
    lora: LoraSettings | None = None,
) -> EngineSpec:
    """What every vLLM engine process needs (its slot's rank is given at start). The pipeline's
    `rollouts_at_once`: rollouts an engine generates together (a CPU KV cache holds them). With more
    than one (async) a weight update lands while requests are in flight; publishing it drops every
    cached block, the running requests' too (vLLM recomputes them: `WeightReceiving.publish`), so
    prefix caching stays on: a request started after an update reuses no keys or values of the old
    weights."""
    rollouts_at_once = getattr(pipeline, "rollouts_at_once", 1)
    return EngineSpec(
        model_path=model_path,
        dtype=typed.model.dtype,
        max_model_len=typed.data.prompt_max_len + typed.data.response_max_len,
        tensor_parallel_size=plan.engine_tp,
        seed=typed.seed,
        kv_cache_bytes=engine_kv_cache_bytes(typed, plan, rollouts_at_once),
        gpu_memory_utilization=memory_utilization(typed.engine.gpu_memory_utilization, plan),
        sleep_level=sleep_level(typed.engine.sleep_level, plan),
        enable_prefix_caching=typed.engine.enable_prefix_caching,
        block_size=typed.engine.block_size,
        enforce_eager=typed.engine.enforce_eager,
        torch_threads=typed.engine.torch_threads,
        max_concurrency=rollouts_at_once,
        finish_before_update=getattr(pipeline, "finishes_requests_before_update", False),
        lora=lora,
    )


def engine_kv_cache_bytes(typed: RootConfig, plan: PlacementPlan, rollouts_at_once: int) -> int | None:
    """engine.kv_cache_gb in bytes; null: on GPUs None (vLLM sizes it from gpu_memory_utilization),
    on CPU the training rollouts the engine generates at once (`cpu_kv_cache_bytes`; a held-out
    evaluation of more runs in waves; 1 GiB for a model of unknown shape)."""
    e = typed.engine
    if e.kv_cache_gb is not None:
        return int(e.kv_cache_gb * 2**30)
    if plan.total_gpus > 0:
        return None
    from rlhf_orch.engines.launch import cpu_kv_cache_bytes, kv_block_size, kv_sequences_per_engine
    from rlhf_orch.memory.shapes import shape_of
    from rlhf_orch.memory.terms import BYTES_PER_ELEMENT

    shape, _ = shape_of(typed.model)
    if shape is None:
        return None  # the engine's CPU_KV_CACHE_UNSIZED_BYTES
    a = typed.algo
    sequences = kv_sequences_per_engine(
        a.rollout_batch_size * a.samples_per_prompt, rollouts_at_once, plan.num_ranks("engine")
    )
    return cpu_kv_cache_bytes(
        sequences,
        typed.data.prompt_max_len + typed.data.response_max_len,
        shape.kv_bytes_per_token(BYTES_PER_ELEMENT[typed.model.dtype]),
        plan.engine_tp,
        kv_block_size(e.block_size, True),
    )


def loop_settings(typed: RootConfig, plan: PlacementPlan, engines: EngineSpec) -> LoopSettings:
    a = typed.algo
    return LoopSettings(
        num_steps=a.num_steps,
        rollout_batch_size=a.rollout_batch_size,
        samples_per_prompt=a.samples_per_prompt,
        micro_batch_size=a.micro_batch_size,
        train_batch_size=a.train_batch_size,
        response_max_len=typed.data.response_max_len,
        min_response_len=a.min_response_len,
        max_seq_len=typed.data.prompt_max_len + typed.data.response_max_len,
        temperature=a.temperature,
        seed=typed.seed,
        step_timeout_s=typed.fault.step_timeout_s,
        max_engine_restarts=typed.fault.max_engine_restarts,
        engine_tp=plan.engine_tp,
        engines_sleep=engines.sleep_level != 0,
        corrects_engine_sampling=a.tis_cap is not None or a.decoupled_is_cap is not None,
    )


def load_resume_point(typed: RootConfig, run_dir: Path, config_dict: dict, task: Any) -> ResumePoint | None:
    """The checkpoint `resume=` names (ResumeError before any actor starts), with the data
    sampler's position and the driver's RNG put back; None for a fresh run."""
    if not typed.resume:
        return None
    ck = typed.checkpoint
    wanted = typed.resume
    if wanted == OWN_RUN_DIR:  # (a requeued Slurm job: its own run dir, never another job's)
        try:
            wanted = str(
                find_checkpoint(str(run_dir), run_dir.parent, ck.dir).path
            )  # (load_resume reads it by its manifest)
        except ResumeError:
            print(
                f"resume={OWN_RUN_DIR}: no complete checkpoint of {run_dir} yet: starting fresh there "
                "(the records of an earlier attempt stay in metrics.jsonl, marked superseded)",
                flush=True,
            )
            return None
    resume = load_resume(wanted, run_dir.parent, ck.dir, config_dict, typed.algo.num_steps, typed.experiment_name)
    task.load_state_dict(resume.state["data"])
    set_rng_state(resume.state["rng"])
    which = (
        f" (resume=auto: the newest checkpoint of experiment {typed.experiment_name!r})"
        if typed.resume == "auto"
        else ""
    )
    print(f"resuming from step {resume.step}: {resume.info.path}{which}", flush=True)
    if resume.state.get("exact") is False:
        print(
            f"resume: the final checkpoint of a failed one-step-off run: step {resume.step + 1}'s rollout is generated "
            "again with the checkpoint's weights (the uninterrupted run drew it one version earlier)",
            flush=True,
        )
    if resume.changed:
        print(f"resume: changed since the checkpoint (allowed): {', '.join(resume.changed)}", flush=True)
    for note in resume.notes:
        print(note, flush=True)
    return resume


def resume_loop(loop: TrainLoop, resume: ResumePoint, actors: Any, timeout_s: float) -> None:
    """The trainers' exact state, then the engines get those weights through the configured sync
    before the first resumed step; a rollout generated ahead of the checkpoint goes back onto the
    engines."""
    restore_trainers(resume.info.path, actors, loop._get, timeout_s)
    loop.trained = resume.state.get("trained_version", resume.state["weight_version"])
    loop.version = -1  # fresh engines: push whatever the checkpoint says
    loop.restart_log = resume.state.get("restart_log") or {0: [0.0] * resume.state["engine_restarts"]}
    loop.sync_engines({})
    loop.first_step = resume.step + 1
    # The sampler's position before each carried rollout's prompts: a checkpoint written while they
    # are still pending records these again (else it would record the position after their draw).
    loop._data_before.update(resume.state.get("data_before_pending") or {})
    loop.pipeline.restore(loop, resume.state.get("pending_rollout"))


def evaluate(step: int, evaluator: Evaluator, loop: TrainLoop, actors: Any) -> dict[str, float]:
    """The evaluation due at `step`, if any. The engines must be idle and hold the trainers' newest
    weights; a rollout they hold for the next step is parked while the evaluation uses them."""
    if not evaluator.should_run(step):
        return {}
    pipeline = loop.pipeline
    held = pipeline.pending(loop) if evaluator.uses_engine_buffers else pipeline.settle(loop)
    # An engine lost during the evaluation: replaced in place where the pipeline redraws what it
    # held (async); elsewhere a lost process (the restart repeats the uninterrupted run exactly).
    route = loop.route(step if pipeline.redraws_lost_shares else None)
    try:
        return evaluator.run(route, actors.reward)
    finally:
        if evaluator.uses_engine_buffers and held is not None:
            pipeline.restore(loop, held)


def _stuck(error: BaseException | None) -> bool:
    """A timeout anywhere in the error's chain (an actor alive but not answering)."""
    while error is not None:
        if isinstance(error, (TimeoutError, ActorTimeoutError, ray.exceptions.GetTimeoutError)):
            return True
        error = error.__cause__
    return False


# Failures a restart cannot help: the same inputs would fail again, or the user set the limit.
_NOT_RESTARTED = (NonFiniteError, EngineRestartBudgetError, ActorStartError)


def processes_lost(error: BaseException, actors: Any, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the failure lost a process of the run: an actor is dead or does not answer within
    `timeout_s` (hung: treated as dead; an engine busy in one long call that makes engine steps
    is neither, `lost_processes`). A failure with every process answering or busy (a bug, a bad
    reward function) is no reason to restart."""
    if isinstance(error, _NOT_RESTARTED):
        return False
    if _stuck(error) or isinstance(error, ActorDiedError):  # (its replacement may answer by now)
        return True
    return bool(lost_processes(actors.all(), timeout_s))


def describe_failure(error: BaseException, actors: Any, last_finished_step: int, in_step: int | None) -> Failure:
    """The plain facts `decide_restart` reads, taken off the exception and the actors once."""
    return Failure(
        error_line=named(error),
        lost_process=processes_lost(error, actors),
        # (A replacement that did not start is no stuck actor: the trainers may still answer.)
        stuck=_stuck(error) and not isinstance(error, ActorStartError),
        point=(last_finished_step, in_step, failure_signature(error)),
    )


def use_lora_sync(actors: RoleActors, timeout_s: float) -> str:
    """model.lora: ask the engines what an update must carry (the adapter, or merged weights where
    vLLM cannot serve the adapter: `VLLMEngine.lora_sync_mode`), tell every policy rank; the start-up line."""
    modes = set(ray.get([e.lora_sync_mode.remote() for e in actors.engines], timeout=timeout_s))
    if len(modes) != 1:
        raise RuntimeError(f"the engines disagree on what a LoRA update carries: {sorted(modes)}")
    mode = modes.pop()
    ray.get([rank.use_lora_sync.remote(mode) for rank in actors.policy], timeout=timeout_s)
    info = ray.get(actors.policy[0].lora_summary.remote(), timeout=timeout_s)
    carried = (
        f"the adapter ({info['adapter_bytes'] / 1e6:.2f} MB; vLLM serves it in memory)"
        if mode == "adapter"
        else f"merged weights ({info['full_bytes'] / 1e6:.1f} MB: the engines cannot take an adapter)"
    )
    return (
        f"lora: rank {info['rank']}, alpha {info['alpha']:g}, {info['layers']} layers -- {info['trainable']:,} of "
        f"{info['total']:,} weights train; each sync sends {carried} (model.lora.sync={info['sync']})"
    )


@dataclass
class _Run:
    """What every attempt of one run shares (a restart is a new attempt: new actors, same record)."""

    cfg: DictConfig
    typed: RootConfig
    plan: PlacementPlan
    inputs: RunInputs
    record: RunRecord
    specs: dict[str, TrainerSpec]
    reward_spec: TrainerSpec | None
    engines: EngineSpec
    stop: StopRequest
    callbacks: Sequence[Callable[[int, TrainLoop], None]]
    run_dir: Path
    t_start: float
    in_step: int | None = None  # the step in progress (named by a failure)
    final_note: str = ""  # what the failure did about a final checkpoint
    warm_key: str = ""  # what kept actors must match to serve this run (launcher.keep_actors)
    # Where every failed attempt failed (a crash loop repeats one)
    failures: list[FailurePoint] = field(default_factory=list)
    # What the last attempt's failure leads to (None: it failed before its actors could be asked)
    decision: RestartDecision | None = None


def _attempt(
    run: _Run, placement: Any, resume: ResumePoint | None, restarted: bool, warm: RoleActors | None = None
) -> dict[str, Any]:
    """Start every role's actors in their bundles (or reset `warm`, an earlier run's) and train to
    the end (or a stop signal) from `resume` (None: step 1). Returns the outcome; a failure is
    raised with `run.decision` and `run.final_note` set while the actors are still there to ask."""
    cfg, typed, ck, record = run.cfg, run.typed, run.typed.checkpoint, run.record
    transfer, sync, pipeline = instantiate(cfg.transfer), instantiate(cfg.sync), instantiate(cfg.pipeline)
    sync.use_plan(run.plan)  # CUDA IPC: which policy rank feeds which engine worker
    run.decision, run.final_note = None, ""
    try:
        actors = start_role_actors(
            run.plan,
            placement,
            run.engines,
            run.specs["actor"],
            run.specs.get("critic"),
            run.specs.get("reference"),
            typed.launcher.startup_timeout_s,
            run.reward_spec,
            warm=warm,
            shares_cuda_memory=sync.shares_cuda_memory,
            stopped=lambda: run.stop.requested,
        )
    except StartupStopped:  # nothing ran, nothing to keep: the actors were killed mid-start
        print(f"{run.stop.name}: stopped during start-up (no step ran)", flush=True)
        return {"status": "interrupted", "signal": run.stop.name}
    loop: TrainLoop | None = None
    completed = False  # only a completed run's actors are kept (nothing of it is left running)
    try:
        if run.specs["actor"].lora is not None:
            line = use_lora_sync(actors, typed.launcher.startup_timeout_s)
            if not restarted:
                print(line, flush=True)
        sync.prepare(actors.policy, actors.engines, run.plan.engine_tp)
        dump = (
            RolloutDump(
                run.run_dir,
                run.inputs.tokenizer,
                typed.logger.rollouts_per_step,
                typed.logger.rollouts_every_n_steps,
            )
            if typed.logger.rollouts
            else None
        )
        loop = TrainLoop(
            actors,
            run.inputs.task,
            run.inputs.tokenizer,
            transfer,
            sync,
            instantiate(cfg.algo),
            loop_settings(typed, run.plan, run.engines),
            run.inputs.reward,
            pipeline,
            run.inputs.env,
            dump,
        )
        if resume:
            resume_loop(loop, resume, actors, ck.timeout_s)
        if record.engine_restart_log is not None:  # a restart: the engine replacements of every attempt count
            loop.restart_log = copy.deepcopy(record.engine_restart_log)
        loop.engine_restarts_before = record.engine_restarts_at_start  # (the budget is this invocation's)
        evaluator = Evaluator(eval_settings(typed), run.inputs.eval_prompts, run.inputs.reward, loop._get, loop.env)
        startup_s = time.perf_counter() - run.t_start

        if not resume and not restarted and evaluator.should_run(0):
            record.log(0, {"step": 0, "weight_version": 0, **evaluate(0, evaluator, loop, actors)})
        record.started(loop)
        for step in range(loop.first_step, typed.algo.num_steps + 1):
            if run.stop.requested:  # arrived before this step started (during start-up or a callback)
                break
            run.in_step = step
            metrics = loop.step(step)
            bad = non_finite(metrics)
            if bad:  # not logged, not checkpointed: the last good checkpoint stays the latest
                raise NonFiniteError(", ".join(bad))
            metrics.update(evaluate(step, evaluator, loop, actors))
            metrics["fault/trainer_restarts"] = record.trainer_restarts
            metrics["time/elapsed"] = time.perf_counter() - run.t_start
            metrics["time/startup"] = startup_s
            record.log(step, metrics)
            record.step_finished(step, loop)
            run.in_step = None
            if record.due(step, step == typed.algo.num_steps, run.stop.requested):
                record.checkpoint(step, loop, actors)
            for callback in run.callbacks:
                callback(step, loop)
        if ck.export_final:
            export_dir = run.run_dir / "policy_hf"
            export_policy(actors, loop._get, export_dir, ck.timeout_s)
            print(f"policy exported (Hugging Face format): {export_dir}", flush=True)
        completed = not run.stop.requested
        return {"status": "interrupted", "signal": run.stop.name} if run.stop.requested else {"status": "completed"}
    except SignalAbort:
        raise
    except Exception as e:
        # Decided here, once, while the actors are there to ask; a run that gives up keeps what the
        # trainers still hold (the last finished step) in a final checkpoint where the decision allows.
        failure = describe_failure(e, actors, record.last_finished_step(), run.in_step)
        record.attempt_failed(loop)
        run.decision = decide_restart(
            failure, run.failures, record.trainer_restarts_used, typed.fault.max_trainer_restarts
        )
        run.failures.append(failure.point)
        run.final_note = (
            record.final_checkpoint(loop, actors, exact_only=run.decision.exact_only)
            if run.decision.final_checkpoint
            else run.decision.final_note
        )
        raise
    finally:
        keep = typed.launcher.keep_actors and completed
        pipeline.close(loop, wait=keep)  # kept engines must not go on generating for this run
        if not (keep and _parked(run, placement, actors)):
            actors.kill()


def _parked(run: _Run, placement: Any, actors: RoleActors) -> bool:
    """Whether the completed run's actors were kept for the next run (a failure to keep them
    leaves them to be killed; it does not fail the run)."""
    try:
        return warm_actors.park(run.warm_key, placement, actors)
    except Exception as e:
        print(f"actors: not kept for the next run ({named(e)})", flush=True)
        return False


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
    (exit 2) before any actor starts. A failure that lost a process restarts every role from the
    last checkpoint, up to fault.max_trainer_restarts times. The summary's `status` is
    "completed", or "interrupted" (a stop signal: `signal` names it) -- the app turns that into
    exit 128 + signal.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    ck = typed.checkpoint
    inputs: RunInputs = prepare_inputs(cfg, typed)
    resume = load_resume_point(typed, run_dir, config_dict, inputs.task)
    written_at = checkpoint_zero_stages(resume.state) if resume else None
    specs = trainer_specs(
        typed,
        plan,
        inputs.model_path,
        inputs.tokenizer.pad_token_id,
        inputs.model.lora,
        written_at,
        teacher_path=inputs.teacher_path,
    )
    zero_stages = {role: s.zero_stage for role, s in specs.items() if role in ("actor", "critic")}
    record = RunRecord(run_dir, typed, config_dict, instantiate(cfg.logger), inputs.task, resume, zero_stages)
    for role, stage in zero_stages.items():
        if stage != zero_stage_to_run(
            typed.trainer.zero_stage, specs[role].data_parallel_size, specs[role].offload_optimizer
        ):
            print(
                f"resume: the {role} runs ZeRO-{stage}, the stage its checkpoint was written at (a new run "
                "runs a one-rank role at stage 0, without ZeRO's fp32 copy of the weights)",
                flush=True,
            )
    for line in inputs.notes:
        print(line, flush=True)
    reward_spec = None
    if inputs.reward_model_path:
        reward_spec = replace(
            specs["actor"],
            lr=0.0,
            model_path=inputs.reward_model_path,
            micro_batch_size=inputs.reward.model.micro_batch_size,
            free_cache_between_phases=plan.shares_gpu("reward"),
        )
    stop = StopRequest("stopping after this step" + (", with a checkpoint" if ck.on_signal else ""))
    run = _Run(
        cfg,
        typed,
        plan,
        inputs,
        record,
        specs,
        reward_spec,
        engine_spec(typed, plan, inputs.model_path, instantiate(cfg.pipeline), inputs.model.lora),
        stop,
        callbacks,
        run_dir,
        time.perf_counter(),
    )
    run.warm_key = warm_actors.warm_key(
        plan, run.engines, typed.engine.kv_cache_gb, [*specs, *(["reward"] if reward_spec else [])]
    )
    outcome: dict[str, Any] = {"status": "failed"}
    try:
        # Installed before Ray starts (a signal during start-up stops the run before its first
        # step) and again after ray.init, which sets a SIGTERM handler of its own.
        with (
            stop.installed(),
            launcher.session(run_dir, typed.logger.verbose),
            stop.installed(),
            warm_actors.placement_for(
                run.warm_key, plan, typed.launcher.startup_timeout_s, typed.launcher.keep_actors
            ) as (placement, warm),
        ):
            restarted = False
            while True:
                try:
                    outcome = _attempt(run, placement, resume, restarted, warm)
                    break
                except SignalAbort:
                    raise
                except Exception as e:
                    decision = run.decision
                    if decision is None or not decision.restart:
                        if decision is not None and decision.give_up_line is not None:
                            raise CrashLoopError(decision.give_up_line) from e
                        raise
                    failed_at = run.in_step
                    resume, restarted, warm = _restart_point(run, e), True, None
                    print(
                        restart_line(
                            _where(failed_at),
                            named(e),
                            resume.step if resume else None,
                            record.trainer_restarts_used,
                            typed.fault.max_trainer_restarts,
                        ),
                        flush=True,
                    )
    except SignalAbort as e:
        outcome = {"status": "aborted", "signal": e.name}
        raise
    except Exception as e:
        if isinstance(e, (InputError, ResumeError)):
            outcome = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            raise
        note = f"; {run.final_note}" if run.final_note else ""
        outcome = {"status": "failed", "error": f"{_where(run.in_step)}{named(e)}{note}"}
        raise RunFailed(f"{_where(run.in_step)}{named(e)}{note}{record.resume_hint()}") from e
    finally:
        summary = record.close(outcome, time.perf_counter() - run.t_start)
    return summary


class CrashLoopError(RuntimeError):
    """A lost process again at the same step with the same error: restarting would repeat it."""


def _where(step: int | None) -> str:
    return f"step {step}: " if step is not None else ""


def _restart_point(run: _Run, error: BaseException) -> ResumePoint | None:
    """Where a restart begins (RunRecord.restart_point); a failure there is the run's failure."""
    try:
        resume = run.record.restart_point(run.typed.algo.num_steps)
    except ResumeError:  # e.g. the last checkpoint is the last step: nothing left to re-run
        raise error
    run.in_step = None
    return resume
