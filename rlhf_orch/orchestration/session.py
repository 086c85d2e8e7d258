"""One training run: build the model once, start Ray and the role actors, loop, tear down."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.algo.experience import AdvantageSettings
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.orchestration.actors import start_role_actors
from rlhf_orch.orchestration.ppo_loop import LoopSettings, PPOLoop
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.trainer.workers import TrainerSpec


def trainer_specs(cfg: RootConfig, plan: PlacementPlan, model_path: str, pad_id: int) -> dict[str, TrainerSpec]:
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
            clip_eps=a.value_clip_eps if role == "critic" else a.clip_eps,
            ppo_epochs=a.ppo_epochs,
            seed=t.seed,
        )

    return {"actor": spec("actor", a.actor_lr), "critic": spec("critic", a.critic_lr), "reference": spec("reference", 0.0)}


def run_training(
    cfg: DictConfig,
    typed: RootConfig,
    plan: PlacementPlan,
    launcher: Any,
    run_dir: Path,
    callbacks: Sequence[Callable[[int, PPOLoop], None]] = (),
) -> dict[str, Any]:
    """Train; `callbacks(step, loop)` run after each finished (and logged) step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = instantiate(cfg.model)
    task = instantiate(cfg.data)
    model_path = model.path()  # builds and caches the tiny model on first use
    tokenizer = model.tokenizer()
    transfer = instantiate(cfg.transfer)
    sync = instantiate(cfg.sync)
    logger = instantiate(cfg.logger)
    metrics_file = MetricsFile(run_dir)
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    logger.start(str(run_dir), config_dict, typed.experiment_name)

    a = typed.algo
    specs = trainer_specs(typed, plan, model_path, tokenizer.pad_token_id)
    engine_spec = EngineSpec(
        model_path=model_path,
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
    t_start = time.perf_counter()
    from rlhf_orch.topology.ray_placement import RayPlacement

    try:
        with launcher.session(), RayPlacement(plan, ready_timeout_s=typed.launcher.startup_timeout_s) as placement:
            actors = start_role_actors(
                plan,
                placement,
                engine_spec,
                specs["actor"],
                specs["critic"],
                specs["reference"],
                typed.launcher.startup_timeout_s,
                typed.engine.kv_cache_gb,
            )
            try:
                sync.prepare(actors.policy, actors.engines, plan.engine_tp)
                loop = PPOLoop(
                    actors,
                    task,
                    tokenizer,
                    transfer,
                    sync,
                    AdvantageSettings(a.gamma, a.lam, a.kl_coef, a.kl_estimator, a.whiten_advantages),
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
                )
                startup_s = time.perf_counter() - t_start
                for step in range(1, a.num_steps + 1):
                    metrics = loop.step(step)
                    metrics["time/elapsed"] = time.perf_counter() - t_start
                    metrics["time/startup"] = startup_s
                    metrics_file.write(metrics)
                    logger.log(step, metrics)
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
        "wall_s": time.perf_counter() - t_start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
