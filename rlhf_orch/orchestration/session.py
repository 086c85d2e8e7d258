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
from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.orchestration.actors import start_role_actors
from rlhf_orch.orchestration.evaluation import EvalSettings, Evaluator
from rlhf_orch.orchestration.inputs import RunInputs, prepare_inputs
from rlhf_orch.orchestration.loop import LoopSettings, TrainLoop
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


def run_training(
    cfg: DictConfig,
    typed: RootConfig,
    plan: PlacementPlan,
    launcher: Any,
    run_dir: Path,
    callbacks: Sequence[Callable[[int, TrainLoop], None]] = (),
) -> dict[str, Any]:
    """Train; `callbacks(step, loop)` run after each finished (and logged) step.

    Everything that can be checked without Ray (the model, the data, the reward) is prepared first:
    `prepare_inputs` raises `InputError` (exit 2) before any actor starts.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    inputs: RunInputs = prepare_inputs(cfg, typed)
    tokenizer, task, reward = inputs.tokenizer, inputs.task, inputs.reward
    transfer = instantiate(cfg.transfer)
    sync = instantiate(cfg.sync)
    logger = instantiate(cfg.logger)
    metrics_file = MetricsFile(run_dir)
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    logger.start(str(run_dir), config_dict, typed.experiment_name)
    for line in inputs.notes:
        print(line, flush=True)

    a = typed.algo
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
        gpu_memory_utilization=typed.engine.gpu_memory_utilization,
        enable_prefix_caching=typed.engine.enable_prefix_caching,
        enforce_eager=typed.engine.enforce_eager,
    )
    rewards: list[float] = []
    evals: list[dict[str, float]] = []
    t_start = time.perf_counter()
    from rlhf_orch.topology.ray_placement import RayPlacement

    def log(step: int, metrics: dict[str, Any]) -> None:
        metrics_file.write(metrics)
        logger.log(step, metrics)

    try:
        with launcher.session(), RayPlacement(plan, ready_timeout_s=typed.launcher.startup_timeout_s) as placement:
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
                        step_timeout_s=max(typed.sync.timeout_s, 600.0),
                    ),
                    reward,
                )
                evaluator = Evaluator(eval_settings(typed), inputs.eval_prompts, reward, loop._get)
                startup_s = time.perf_counter() - t_start

                def evaluate(step: int) -> dict[str, float]:
                    if not evaluator.should_run(step):
                        return {}
                    result = evaluator.run(actors.engines, actors.reward)
                    evals.append({"step": step, **result})
                    return result

                if evaluator.should_run(0):
                    log(0, {"step": 0, "weight_version": 0, **evaluate(0)})
                for step in range(1, a.num_steps + 1):
                    metrics = loop.step(step)
                    metrics.update(evaluate(step))
                    metrics["time/elapsed"] = time.perf_counter() - t_start
                    metrics["time/startup"] = startup_s
                    log(step, metrics)
                    rewards.append(metrics["reward/mean"])
                    for callback in callbacks:
                        callback(step, loop)
            finally:
                actors.kill()
    finally:
        metrics_file.close()
        logger.close()

    k = max(1, min(5, len(rewards) // 3))
    summary = {
        "run_dir": str(run_dir),
        "steps": len(rewards),
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "wall_s": time.perf_counter() - t_start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
