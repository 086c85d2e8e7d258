"""An experiment scaled to a CPU machine: same algorithm, estimator, transfer and sync strategies,
the same placement shape on Ray logical GPUs, the batch ratios kept -- the tiny model and the
embedded task in veRL's file layout instead of the published model and data.

`scale_to_cpu(cfg)` is pure: the composed published config in, Hydra overrides and the list of
what had to be reduced (and why) out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

# CPU backends of the GPU-only sync strategies: the same strategy class over gloo where it can run
# with the scaled layout's single policy rank (multi-sender needs two; CUDA IPC needs CUDA).
_CPU_SYNC = {
    "per_tensor": "gloo_per_tensor",
    "bucketed": "gloo_bucketed",
    "multi_sender": "gloo_bucketed",
    "cuda_ipc": "gloo_bucketed",
}
_SYNC_OPTION = {
    "rlhf_orch.sync.per_tensor.PerTensorBroadcastSync": "per_tensor",
    "rlhf_orch.sync.bucketed.BucketedBroadcastSync": "bucketed",
    "rlhf_orch.sync.multi_sender.MultiSenderBroadcastSync": "multi_sender",
    "rlhf_orch.sync.cuda_ipc.CudaIpcSync": "cuda_ipc",
    "rlhf_orch.sync.object_store.ObjectStoreSync": "object_store",
}
SCALED_PROMPTS = 8  # prompts per step on 2 cores


@dataclass
class Scaled:
    overrides: list[str] = field(default_factory=list)
    reductions: list[str] = field(default_factory=list)  # "<dimension>: published -> here (why)"


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(min(n, k), 1) + 1) if n % d == 0)


def scale_to_cpu(cfg: DictConfig, steps: int, data_files: dict[str, str]) -> Scaled:
    """Overrides turning the published experiment into a few-step run on this machine."""
    out = Scaled()
    o, why = out.overrides, out.reductions
    a, p = cfg.algo, cfg.placement
    critic = bool(OmegaConf.select(cfg, "algo.critic_lr") is not None)

    # Model and data: the tiny policy and the embedded task, through the same data class (files).
    o += [
        "model=tiny",
        "data=files",
        f"data.train_files=[{data_files['train']}]",
        f"data.val_files=[{data_files['test']}]",
        "data.prompt_max_len=32",
        "data.response_max_len=16",
    ]
    why.append(
        f"model: {cfg.model.get('name_or_path', cfg.model._target_)} -> the tiny local Llama (no download possible; 2 CPU cores)"
    )
    if cfg.reward.get("model_path", "absent") != "absent":
        # A reward-model role stays a reward-model role: the tiny one, built for the tiny policy.
        o += ["reward=model", "reward.model_path=null"]
        why.append(f"reward model: {cfg.reward.model_path} -> the tiny reward model (same role, placed the same way)")
        why.append(f"data: {cfg.data._target_.rsplit('.', 1)[-1]} -> the digit task in veRL's parquet layout")
    else:
        o.append("reward=digit_reverse")
        why.append(
            f"data/reward: {cfg.data._target_.rsplit('.', 1)[-1]} + {cfg.reward._target_.rsplit('.', 1)[-1]} -> the digit task "
            "in veRL's parquet layout + its rule (the only task the tiny model can learn)"
        )

    # Placement: the same layout on the fewest logical GPUs that keep its shape.
    layout = p._target_.rsplit(".", 1)[-1]
    nodes, gpus = int(p.get("nodes", 1)), int(p.get("gpus_per_node", 0))
    if layout == "ColocatedPlacement":
        o += [
            "placement.nodes=1",
            "placement.gpus_per_node=1",
            "placement.actor_ranks=1",
            "placement.critic_ranks=1",
            "placement.reference_ranks=1",
            "placement.engines=1",
            "placement.engine_tp=1",
            "launcher.logical_gpus=1",
        ]
        why.append(
            f"placement: colocated on {nodes} x {gpus} GPUs -> colocated on 1 logical GPU (every role shares it, as published)"
        )
    elif layout == "SplitPlacement":
        o += [
            "placement.nodes=1",
            "placement.ratio=null",
            "placement.actor_gpus=1",
            f"placement.critic_gpus={1 if critic else 0}",
            "placement.vllm_gpus=1",
            "placement.engine_tp=1",
            f"launcher.logical_gpus={3 if critic else 2}",
        ]
        o.append(f"placement.gpus_per_node={3 if critic else 2}")
        why.append(
            f"placement: split on {nodes} x {gpus} GPUs -> split on {3 if critic else 2} logical GPUs "
            "(trainer and vLLM GPUs still disjoint; one of each role: 2 cores)"
        )
    else:
        o += ["placement=cpu_local"]
    if int(p.get("engine_tp", 1)) > 1:
        why.append(f"placement.engine_tp: {p.engine_tp} -> 1 (a tensor-parallel vLLM engine needs one core per rank)")

    # Batches: fewer prompts, the published optimizer steps per rollout and samples per prompt kept.
    spp = int(a.samples_per_prompt)
    spp_here = min(spp, 4) if spp > 1 else 1
    if spp_here != spp:
        why.append(f"algo.samples_per_prompt: {spp} -> {spp_here} (CPU time)")
    sequences = SCALED_PROMPTS * spp_here
    updates = max(1, (int(a.rollout_batch_size) * spp) // int(a.train_batch_size))
    train = _largest_divisor_at_most(sequences, max(1, sequences // updates))
    micro = _largest_divisor_at_most(train, min(int(a.micro_batch_size), train))
    o += [
        f"algo.rollout_batch_size={SCALED_PROMPTS}",
        f"algo.samples_per_prompt={spp_here}",
        f"algo.train_batch_size={train}",
        f"algo.micro_batch_size={micro}",
        f"algo.num_steps={steps}",
    ]
    why.append(
        f"algo.rollout_batch_size: {a.rollout_batch_size} -> {SCALED_PROMPTS} prompts; optimizer steps per rollout kept "
        f"({updates}: train_batch_size {a.train_batch_size} -> {train}); micro_batch_size {a.micro_batch_size} -> {micro}"
    )
    why.append(f"algo.num_steps: {a.num_steps} -> {steps}")
    buffer = int(a.get("overlong_buffer", 0) or 0)
    if buffer:
        # DAPO's overlong ramp keeps its share of the response length.
        scaled_buffer = max(1, round(buffer * 16 / int(cfg.data.response_max_len)))
        o.append(f"algo.overlong_buffer={scaled_buffer}")
        why.append(
            f"algo.overlong_buffer: {buffer} of {cfg.data.response_max_len} tokens -> {scaled_buffer} of 16 (the same share)"
        )
    if cfg.eval.every_n_steps or cfg.eval.before_train:
        o += ["eval.every_n_steps=1", "eval.num_prompts=8", "eval.samples_per_prompt=1", "eval.temperature=0"]

    # Sync: the same strategy on the CPU transport.
    option = _SYNC_OPTION.get(cfg.sync._target_, "bucketed")
    if cfg.sync.backend in ("nccl", "cuda_ipc") or option == "multi_sender":
        name = _CPU_SYNC[option]
        o.append(f"sync={name}")
        reason = "no CUDA here" if option != "multi_sender" else "one policy rank here; multi-sender needs two"
        why.append(f"sync: {option} over {cfg.sync.backend} -> {name} ({reason}; the nearest strategy over gloo)")
    if int(cfg.trainer.zero_stage) == 3:
        why.append("trainer.zero_stage: 3 kept (gloo)")
    if cfg.trainer.get("offload_optimizer"):
        o.append("trainer.offload_optimizer=false")
        why.append(
            "trainer.offload_optimizer: true -> false (it saves GPU memory; on CPU the states are in host memory already)"
        )
    if cfg.trainer.get("reference_memory", "full") != "full":
        o.append("trainer.reference_memory=full")
        why.append(
            f"trainer.reference_memory: {cfg.trainer.reference_memory} -> full (one reference rank here: nothing to shard it over)"
        )
    return out


def flat(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> values of a config (resolved), for the exact difference of two configs."""
    node = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(published: DictConfig, scaled: DictConfig) -> list[tuple[str, Any, Any]]:
    a, b = flat(published), flat(scaled)
    skip = ("reference", "hydra")
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(skip))
    return [
        (k, a.get(k, "(absent)"), b.get(k, "(absent)")) for k in keys if a.get(k, "(absent)") != b.get(k, "(absent)")
    ]
