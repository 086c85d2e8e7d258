"""What each role's processes, the loop and the evaluation are started with, derived from the
composed config and the run's inputs (the model's checkpoint, its tokenizer's pad id): plain
functions the session calls before it starts anything."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.engines.launch import memory_utilization, sleep_level
from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.orchestration.evaluation import EvalSettings
from rlhf_orch.orchestration.loop import LoopSettings
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
) -> dict[str, TrainerSpec]:
    """Per trainer role, what its processes need (roles the algorithm has no use for get none).
    `lora`: the model option's adapters (model.lora), trained by the policy only. The ZeRO stage
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
        )

    # model.lora trains the policy's adapters only; the critic and the reference are full models.
    specs = {"actor": replace(spec("actor", a.actor_lr), lora=lora)}
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
    )


def trainer_roles(typed: RootConfig, plan: PlacementPlan) -> list[str]:
    """The trainer roles a run starts processes for: the keys of `trainer_specs`, and "reward" for
    a reward model's ranks."""
    a = typed.algo
    roles = ["actor", *(["critic"] if a.needs_critic else []), *(["reference"] if a.needs_reference else [])]
    return roles + (["reward"] if plan.num_ranks("reward") > 0 else [])
