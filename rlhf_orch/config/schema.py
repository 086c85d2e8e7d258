"""The root of the structured config schema and its registry.

Every group option in `conf/` extends one dataclass declared next to the code that uses it
(`rlhf_orch/<package>/options.py`: `rlhf_orch.sync.options`, `rlhf_orch.env.options`, ...; the
run's own sections in `rlhf_orch.config.run_options`). Its YAML's `defaults` list names the schema
stored below, so a misspelt key or a wrong type is refused by Hydra/OmegaConf at compose time, before
anything starts. `_target_` names the class `hydra.utils.instantiate` builds; the other fields are
that class's constructor arguments. Every declaration stays importable from here.

Derived quantities (divisibility, GPU counts, lengths) are checked in `rlhf_orch.config.validate`.
"""

from __future__ import annotations

import dataclasses
import typing

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from rlhf_orch.topology.options import (
    PlacementConfig,
    RankedPlacementConfig,
    CpuLocalPlacementConfig,
    ColocatedPlacementConfig,
    SplitPlacementConfig,
)
from rlhf_orch.transfer.options import (
    TransferConfig,
    PaddedTransferConfig,
    PackedTransferConfig,
    MicroBatchedTransferConfig,
)
from rlhf_orch.config.run_options import (
    PipelineConfig,
    AsyncPipelineConfig,
    EvalConfig,
    CheckpointConfig,
    FaultConfig,
)
from rlhf_orch.sync.options import (
    SyncConfig,
    PerTensorSyncConfig,
    BucketedSyncConfig,
    MultiSenderSyncConfig,
    ObjectStoreSyncConfig,
    CudaIpcSyncConfig,
)
from rlhf_orch.data.options import (
    DataConfig,
    DigitTaskConfig,
    LookupTaskConfig,
    FilesDataConfig,
    ReasoningGymDataConfig,
)
from rlhf_orch.reward.options import (
    RewardConfig,
    RuleRewardConfig,
    DigitRuleConfig,
    GSM8KRuleConfig,
    MathVerifyRuleConfig,
    CountdownRuleConfig,
    ReasoningGymRuleConfig,
    CustomRewardConfig,
    ModelRewardConfig,
)
from rlhf_orch.env.options import (
    EnvConfig,
    SingleTurnEnvConfig,
    MultiTurnEnvConfig,
    CustomEnvConfig,
    SkyRLEnvConfig,
    LookupEnvConfig,
    PythonToolEnvConfig,
    AgentEnvConfig,
)
from rlhf_orch.models.options import (
    LoraConfig,
    ModelConfig,
    TinyModelConfig,
    HFModelConfig,
    PackagedGGUFModelConfig,
)
from rlhf_orch.algo.options import (
    AlgoConfig,
    PPOConfig,
    GRPOConfig,
    RLOOConfig,
    ReinforcePPConfig,
    DAPOConfig,
    OnPolicyDistillConfig,
    LOSS_AGGREGATIONS,
    KL_DIVERGENCE_ESTIMATORS,
)
from rlhf_orch.trainer.options import (
    TrainerConfig,
)
from rlhf_orch.engines.options import (
    EngineConfig,
)
from rlhf_orch.logging.options import (
    LoggerConfig,
    ConsoleLoggerConfig,
    WandbLoggerConfig,
)
from launchers.options import (
    LauncherConfig,
    LocalLauncherConfig,
    ClusterLauncherConfig,
)


# Every declaration stays importable from here (`from rlhf_orch.config.schema import SyncConfig`).
__all__ = [
    "PlacementConfig",
    "RankedPlacementConfig",
    "CpuLocalPlacementConfig",
    "ColocatedPlacementConfig",
    "SplitPlacementConfig",
    "TransferConfig",
    "PaddedTransferConfig",
    "PackedTransferConfig",
    "MicroBatchedTransferConfig",
    "PipelineConfig",
    "AsyncPipelineConfig",
    "EvalConfig",
    "CheckpointConfig",
    "FaultConfig",
    "SyncConfig",
    "PerTensorSyncConfig",
    "BucketedSyncConfig",
    "MultiSenderSyncConfig",
    "ObjectStoreSyncConfig",
    "CudaIpcSyncConfig",
    "DataConfig",
    "DigitTaskConfig",
    "LookupTaskConfig",
    "FilesDataConfig",
    "ReasoningGymDataConfig",
    "RewardConfig",
    "RuleRewardConfig",
    "DigitRuleConfig",
    "GSM8KRuleConfig",
    "MathVerifyRuleConfig",
    "CountdownRuleConfig",
    "ReasoningGymRuleConfig",
    "CustomRewardConfig",
    "ModelRewardConfig",
    "EnvConfig",
    "SingleTurnEnvConfig",
    "MultiTurnEnvConfig",
    "CustomEnvConfig",
    "SkyRLEnvConfig",
    "LookupEnvConfig",
    "PythonToolEnvConfig",
    "AgentEnvConfig",
    "LoraConfig",
    "ModelConfig",
    "TinyModelConfig",
    "HFModelConfig",
    "PackagedGGUFModelConfig",
    "AlgoConfig",
    "PPOConfig",
    "GRPOConfig",
    "RLOOConfig",
    "ReinforcePPConfig",
    "DAPOConfig",
    "OnPolicyDistillConfig",
    "LOSS_AGGREGATIONS",
    "KL_DIVERGENCE_ESTIMATORS",
    "TrainerConfig",
    "EngineConfig",
    "LoggerConfig",
    "ConsoleLoggerConfig",
    "WandbLoggerConfig",
    "LauncherConfig",
    "LocalLauncherConfig",
    "ClusterLauncherConfig",
    "RootConfig",
    "SCHEMA_GROUP",
    "register_configs",
]


# --------------------------------------------------------------------------- root
@dataclass
class RootConfig:
    placement: PlacementConfig = MISSING
    pipeline: PipelineConfig = MISSING
    transfer: TransferConfig = MISSING
    sync: SyncConfig = MISSING
    data: DataConfig = MISSING
    reward: RewardConfig = MISSING
    env: EnvConfig = MISSING
    model: ModelConfig = MISSING
    # A model option (conf/teacher mirrors conf/model) whose log-prob of every sampled token the
    # algorithm's teacher term reads (algo.distill_coef; algo=on_policy_distill); null = none.
    teacher: Optional[Any] = None
    algo: AlgoConfig = MISSING
    logger: LoggerConfig = MISSING
    launcher: LauncherConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    # Continue a run: a run dir, a checkpoint dir, "auto" (the latest checkpoint of this
    # experiment_name) or "run_dir" (the run's own hydra.run.dir: its newest checkpoint, or a fresh
    # start there if it has none -- what a requeued Slurm job runs with).
    resume: Optional[str] = None
    # The one seed of a run: the engines' sampling (per step and engine), the data order (data.seed)
    # and the trainers' RNG (trainer.seed) follow it; set those two to pin one part alone.
    seed: int = 1
    experiment_name: str = "default"
    # A published run this experiment reproduces: source, hardware, the published numbers with the
    # metric that measures each and its tolerance (conf/experiment/*.yaml; scripts/reproduce.py).
    reference: Optional[Any] = None


# The schema each group option extends, stored in the ConfigStore under `schema/<group>/<name>`
# (never a group option itself: `python run.py placement=split` picks conf/placement/split.yaml,
# which starts with `defaults: [/schema/placement/split@_here_, _self_]`; there is no
# `placement=<schema>` to pick). The root schema is `schema/root`, conf/config.yaml's first default.
SCHEMA_GROUP = "schema"
_GROUP_SCHEMAS: dict[str, dict[str, Any]] = {
    "placement": {
        "cpu_local": CpuLocalPlacementConfig,
        "colocated": ColocatedPlacementConfig,
        "split": SplitPlacementConfig,
    },
    "pipeline": {"base": PipelineConfig, "async": AsyncPipelineConfig},
    "transfer": {
        "padded": PaddedTransferConfig,
        "packed": PackedTransferConfig,
        "micro_batched": MicroBatchedTransferConfig,
    },
    "sync": {
        "per_tensor": PerTensorSyncConfig,
        "bucketed": BucketedSyncConfig,
        "multi_sender": MultiSenderSyncConfig,
        "object_store": ObjectStoreSyncConfig,
        "cuda_ipc": CudaIpcSyncConfig,
    },
    "data": {
        "digit_task": DigitTaskConfig,
        "lookup_task": LookupTaskConfig,
        "files": FilesDataConfig,
        "reasoning_gym": ReasoningGymDataConfig,
    },
    "reward": {
        "digit_rule": DigitRuleConfig,
        "gsm8k": GSM8KRuleConfig,
        "math_verify": MathVerifyRuleConfig,
        "countdown": CountdownRuleConfig,
        "reasoning_gym": ReasoningGymRuleConfig,
        "custom": CustomRewardConfig,
        "model": ModelRewardConfig,
    },
    "env": {
        "single_turn": SingleTurnEnvConfig,
        "custom": CustomEnvConfig,
        "skyrl": SkyRLEnvConfig,
        "python_tool": PythonToolEnvConfig,
        "lookup": LookupEnvConfig,
        "agent": AgentEnvConfig,
    },
    "model": {"tiny": TinyModelConfig, "hf": HFModelConfig, "packaged_gguf": PackagedGGUFModelConfig},
    "algo": {
        "ppo": PPOConfig,
        "grpo": GRPOConfig,
        "rloo": RLOOConfig,
        "reinforce_pp": ReinforcePPConfig,
        "dapo": DAPOConfig,
        "on_policy_distill": OnPolicyDistillConfig,
    },
    "logger": {"console": ConsoleLoggerConfig, "wandb": WandbLoggerConfig},
    "launcher": {"local": LocalLauncherConfig, "cluster": ClusterLauncherConfig},
}


def _run_dir(resume: Optional[str], experiment_name: str, checkpoint_dir: Optional[str], default: str) -> str:
    """`hydra.run.dir`: a resumed run writes into its own run dir (metrics continue in place)."""
    if not resume:
        return default
    from rlhf_orch.checkpoint_dirs import run_dir_of

    return run_dir_of(resume, default, experiment_name, checkpoint_dir)


def _hydra_subdir(resume: Optional[str], now: str) -> str:
    """`hydra.output_subdir`: a resume keeps the original run's .hydra/ and adds its own beside it."""
    return f".hydra/resume-{now}" if resume else ".hydra"


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (idempotent), under
    `schema/`; register the resolvers conf/ uses."""
    OmegaConf.register_new_resolver("rlhf_run_dir", _run_dir, replace=True)
    OmegaConf.register_new_resolver("rlhf_hydra_subdir", _hydra_subdir, replace=True)
    from rlhf_orch.config.help import help_resolver

    OmegaConf.register_new_resolver("rlhf_help_groups", help_resolver, replace=True)
    cs = ConfigStore.instance()
    cs.store(group=SCHEMA_GROUP, name="root", node=RootConfig)
    for group, schemas in _GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=_with_open_dicts(node))


def _with_open_dicts(schema: type) -> Any:
    """The schema as a config node whose free-form mappings (`env.env_config`, `data.task_config`,
    `env.chat_template_kwargs`: options passed through to another library) take new keys on the
    command line without Hydra's `+` (`env.env_config.db_path=...`); every other key stays closed."""
    node = OmegaConf.structured(schema)
    for f in dataclasses.fields(schema):
        if typing.get_origin(f.type) is dict or f.type is dict or str(f.type).startswith("dict["):
            OmegaConf.set_struct(node[f.name], False)
    return node
