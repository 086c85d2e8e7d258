"""The one structured config schema.

Every group option in `conf/` extends one of these dataclasses (its YAML's `defaults` list names the
schema stored below), so a misspelt key or a wrong type is refused by Hydra/OmegaConf at compose
time, before anything starts. `_target_` names the class `hydra.utils.instantiate` builds; the other
fields are that class's constructor arguments.

Derived quantities (divisibility, GPU counts, lengths) are checked in `rlhf_orch.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


# --------------------------------------------------------------------------- placement
@dataclass
class PlacementConfig:
    """Where every role runs. Counts are ranks/engines; GPU fields are per role."""

    _target_: str = MISSING
    actor_ranks: int = 1  # DeepSpeed data-parallel ranks of the policy
    critic_ranks: int = 1  # DeepSpeed data-parallel ranks of the value model
    reference_ranks: int = 1  # forward-only copies of the initial policy
    engines: int = 1  # vLLM engines
    engine_tp: int = 1  # tensor-parallel size of one engine (GPUs per engine)
    reward: str = "function"  # "function" (rule, no resources) or "model" (a ranked reward model)
    nodes: int = 1
    gpus_per_node: int = 0


@dataclass
class CpuLocalPlacementConfig(PlacementConfig):
    _target_: str = "rlhf_orch.topology.placement.CpuLocalPlacement"


@dataclass
class ColocatedPlacementConfig(PlacementConfig):
    """Every role shares every GPU; each role takes a fraction of each GPU."""

    _target_: str = "rlhf_orch.topology.placement.ColocatedPlacement"
    gpus_per_node: int = 8
    # Fractions of one GPU each role's process claims on a shared bundle (sum must be <= 1).
    actor_fraction: float = 0.25
    critic_fraction: float = 0.25
    reference_fraction: float = 0.15
    engine_fraction: float = 0.35


@dataclass
class SplitPlacementConfig(PlacementConfig):
    """Trainer GPUs and vLLM GPUs are disjoint.

    Either give `ratio` ("trainer:vllm", e.g. "1:1") and let the planner split all GPUs, or give the
    per-role GPU counts. Reference ranks share the actor's GPUs (fractional), the reward model
    (if any) shares the critic's.
    """

    _target_: str = "rlhf_orch.topology.placement.SplitPlacement"
    gpus_per_node: int = 8
    ratio: Optional[str] = None
    actor_gpus: int = 4
    critic_gpus: int = 2
    vllm_gpus: int = 2
    reference_fraction: float = 0.25


# --------------------------------------------------------------------------- transfer
@dataclass
class TransferConfig:
    """How rollout experience moves from engines to trainer ranks."""

    _target_: str = MISSING
    # Bound on micro-batches handed over but not yet consumed (streaming strategies).
    max_in_flight: int = 4
    # Tokens per packed micro-batch (packed strategy); 0 = derive from micro_batch_size * max_len.
    token_budget: int = 0


# --------------------------------------------------------------------------- sync
@dataclass
class SyncConfig:
    """How weights move from trainer rank(s) to every engine after each step.

    The ClassVars are not config keys: they say what each strategy needs, for
    `validate._sync_backend` (no per-strategy branches there).
    """

    _target_: str = MISSING
    backend: str = "gloo"  # "gloo" or "nccl"; honoured, never silently replaced
    timeout_s: float = 120.0

    backends: ClassVar[tuple[str, ...]] = ("gloo", "nccl")  # transports this strategy can use
    needs_colocated_engines: ClassVar[bool] = False  # engine and trainer share a GPU (CUDA IPC)
    min_policy_ranks: ClassVar[int] = 1


@dataclass
class PerTensorSyncConfig(SyncConfig):
    _target_: str = "rlhf_orch.sync.per_tensor.PerTensorBroadcastSync"


@dataclass
class BucketedSyncConfig(SyncConfig):
    _target_: str = "rlhf_orch.sync.bucketed.BucketedBroadcastSync"
    bucket_mb: float = 256.0


@dataclass
class MultiSenderSyncConfig(BucketedSyncConfig):
    """Several policy ranks send at once, each a share of the buckets (or of the engines)."""

    _target_: str = "rlhf_orch.sync.multi_sender.MultiSenderBroadcastSync"
    senders: int = 2  # used: min(senders, placement.actor_ranks)
    shard_by: str = "buckets"  # "buckets" or "engines"

    min_policy_ranks: ClassVar[int] = 2


@dataclass
class ObjectStoreSyncConfig(SyncConfig):
    """Buckets through Ray's object store: no collective group between trainer and engines."""

    _target_: str = "rlhf_orch.sync.object_store.ObjectStoreSync"
    backend: str = "ray"
    bucket_mb: float = 256.0

    backends: ClassVar[tuple[str, ...]] = ("ray",)


@dataclass
class CudaIpcSyncConfig(SyncConfig):
    """Colocated trainer and engine on one GPU: CUDA IPC handles of bucket buffers, no link."""

    _target_: str = "rlhf_orch.sync.cuda_ipc.CudaIpcSync"
    backend: str = "cuda_ipc"
    bucket_mb: float = 512.0

    backends: ClassVar[tuple[str, ...]] = ("cuda_ipc",)
    needs_colocated_engines: ClassVar[bool] = True


# --------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """A prompt source with a rule-based reward."""

    _target_: str = MISSING
    prompt_max_len: int = 32  # tokens
    response_max_len: int = 16  # tokens generated at most
    seed: int = 1234


@dataclass
class DigitTaskConfig(DataConfig):
    """The embedded verifiable task (see rlhf_orch.data.digit_task)."""

    _target_: str = "rlhf_orch.data.digit_task.DigitReverseTask"
    min_digits: int = 3
    max_digits: int = 5
    filler_tokens: int = 0  # extra context tokens in front of the task (for long-context runs)


# --------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    _target_: str = MISSING
    context_len: int = 2048  # max_position_embeddings the engines and trainers may use
    dtype: str = "float32"  # "float32" on CPU, "bfloat16" on GPUs


@dataclass
class TinyModelConfig(ModelConfig):
    """A small Llama and tokenizer built locally, warm-started on the embedded task, cached."""

    _target_: str = "rlhf_orch.models.tiny.TinyLlama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # head_dim = hidden/heads must be >= 32 for vLLM's CPU attention
    intermediate_size: int = 256
    vocab_size: int = 64
    warmup_steps: int = 150  # short supervised warm start so PPO starts from partial skill
    cache_dir: str = "${oc.env:RLHF_ORCH_CACHE,${oc.env:HOME}/.cache/rlhf_orch}"


@dataclass
class HFModelConfig(ModelConfig):
    """A Hugging Face checkpoint (GPU clusters)."""

    _target_: str = "rlhf_orch.models.hf.HFModel"
    name_or_path: str = MISSING
    dtype: str = "bfloat16"


# --------------------------------------------------------------------------- algo
@dataclass
class PPOConfig:
    _target_: str = "rlhf_orch.algo.ppo.PPO"
    num_steps: int = 100
    rollout_batch_size: int = 32  # prompts per step
    samples_per_prompt: int = 4
    train_batch_size: int = 64  # sequences per optimizer step (global)
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    ppo_epochs: int = 1
    actor_lr: float = 1e-4
    critic_lr: float = 5e-4
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    kl_coef: float = 0.01
    kl_estimator: str = "k1"  # "k1" or "k3"
    whiten_advantages: bool = True
    temperature: float = 1.0
    grad_clip: float = 1.0


# --------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    """DeepSpeed settings shared by actor and critic."""

    zero_stage: int = 0
    weight_decay: float = 0.0
    seed: int = 1


# --------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    """vLLM engine settings."""

    kv_cache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    enforce_eager: bool = True


# --------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    _target_: str = MISSING


@dataclass
class ConsoleLoggerConfig(LoggerConfig):
    _target_: str = "rlhf_orch.logging.console.ConsoleLogger"


@dataclass
class WandbLoggerConfig(LoggerConfig):
    _target_: str = "rlhf_orch.logging.wandb_logger.WandbLogger"
    project: str = "rlhf_orch"
    mode: Optional[str] = None  # None: "online" if WANDB_API_KEY is set, else "offline"
    entity: Optional[str] = None


# --------------------------------------------------------------------------- launcher
@dataclass
class LauncherConfig:
    _target_: str = MISSING
    dry_run: bool = False  # print the placement plan and exit without starting actors
    # Ray logical GPUs to declare when the machine has none (CPU testing of GPU layouts).
    logical_gpus: int = 0
    num_cpus: Optional[int] = None
    address: Optional[str] = None
    startup_timeout_s: float = 600.0


@dataclass
class LocalLauncherConfig(LauncherConfig):
    _target_: str = "launchers.local.LocalRayLauncher"


@dataclass
class ClusterLauncherConfig(LauncherConfig):
    _target_: str = "launchers.cluster.ClusterRayLauncher"
    address: Optional[str] = "auto"


# --------------------------------------------------------------------------- root
@dataclass
class RootConfig:
    placement: PlacementConfig = MISSING
    transfer: TransferConfig = MISSING
    sync: SyncConfig = MISSING
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    algo: PPOConfig = MISSING
    logger: LoggerConfig = MISSING
    launcher: LauncherConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 1
    experiment_name: str = "default"


# Schemas each group option extends: conf/<group>/<option>.yaml starts with
# `defaults: [/schema/<group>/<schema>@_here_, _self_]` ... kept as plain group entries below.
_GROUP_SCHEMAS: dict[str, dict[str, Any]] = {
    "placement": {
        "cpu_local_schema": CpuLocalPlacementConfig,
        "colocated_schema": ColocatedPlacementConfig,
        "split_schema": SplitPlacementConfig,
    },
    "transfer": {"transfer_schema": TransferConfig},
    "sync": {
        "per_tensor_schema": PerTensorSyncConfig,
        "bucketed_schema": BucketedSyncConfig,
        "multi_sender_schema": MultiSenderSyncConfig,
        "object_store_schema": ObjectStoreSyncConfig,
        "cuda_ipc_schema": CudaIpcSyncConfig,
    },
    "data": {"digit_task_schema": DigitTaskConfig},
    "model": {"tiny_schema": TinyModelConfig, "hf_schema": HFModelConfig},
    "algo": {"ppo_schema": PPOConfig},
    "logger": {"console_schema": ConsoleLoggerConfig, "wandb_schema": WandbLoggerConfig},
    "launcher": {"local_schema": LocalLauncherConfig, "cluster_schema": ClusterLauncherConfig},
}


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="rlhf_config_schema", node=RootConfig)
    for group, schemas in _GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
