"""The one structured config schema.

Every group option in `conf/` extends one of these dataclasses (its YAML's `defaults` list names the
schema stored below), so a misspelt key or a wrong type is refused by Hydra/OmegaConf at compose
time, before anything starts. `_target_` names the class `hydra.utils.instantiate` builds; the other
fields are that class's constructor arguments.

Derived quantities (divisibility, GPU counts, lengths) are checked in `rlhf_orch.config.validate`.
"""

from __future__ import annotations

import dataclasses
import typing

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf


# --------------------------------------------------------------------------- placement
@dataclass
class PlacementConfig:
    """Where every role runs: the fields every layout has."""

    _target_: str = MISSING
    engine_tp: int = 1  # tensor-parallel size of one engine (GPUs per engine)
    nodes: int = 1
    gpus_per_node: int = 0
    # Reference ranks inside the policy ranks' processes (one process less per policy rank):
    # null = wherever the plan allows (a reference rank per policy rank, on its node and GPU),
    # true = required, false = a process per reference rank.
    reference_in_actor: Optional[bool] = None


@dataclass
class RankedPlacementConfig(PlacementConfig):
    """Layouts whose rank and engine counts are set directly (split derives them from GPU counts)."""

    actor_ranks: int = 1  # DeepSpeed data-parallel ranks of the policy
    critic_ranks: int = 1  # DeepSpeed data-parallel ranks of the value model
    reference_ranks: int = 1  # forward-only copies of the initial policy
    engines: int = 1  # vLLM engines


@dataclass
class CpuLocalPlacementConfig(RankedPlacementConfig):
    _target_: str = "rlhf_orch.topology.placement.CpuLocalPlacement"


@dataclass
class ColocatedPlacementConfig(RankedPlacementConfig):
    """Every role shares every GPU; each role takes a fraction of each GPU."""

    _target_: str = "rlhf_orch.topology.placement.ColocatedPlacement"
    gpus_per_node: int = 8
    # Fractions of one GPU each role's process claims on a shared bundle (sum must be <= 1).
    actor_fraction: float = 0.25
    critic_fraction: float = 0.25
    reference_fraction: float = 0.15
    engine_fraction: float = 0.35
    gpu_memory_gb: Optional[float] = None  # one GPU as sold: 80 for an 80GB A100/H100; null = this machine's GPU (the memory plan)
    # one node's RAM as sold (GiB; null = this machine's where it has CUDA GPUs, else not planned): what
    # offloaded optimizer states and sleeping engines' weights take on the host (the memory plan)
    host_memory_gb: Optional[float] = None


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
    gpu_memory_gb: Optional[float] = None  # one GPU as sold: 80 for an 80GB A100/H100; null = this machine's GPU (the memory plan)
    # one node's RAM as sold (GiB; null = this machine's where it has CUDA GPUs, else not planned): what
    # offloaded optimizer states and sleeping engines' weights take on the host (the memory plan)
    host_memory_gb: Optional[float] = None
    # Derived from the GPU counts (a policy rank per actor GPU with a reference beside it, a critic
    # rank per critic GPU, an engine per engine_tp vLLM GPUs); a value is refused, naming the key to set.
    actor_ranks: Optional[int] = None
    critic_ranks: Optional[int] = None
    reference_ranks: Optional[int] = None
    engines: Optional[int] = None


# --------------------------------------------------------------------------- transfer
@dataclass
class TransferConfig:
    """How rollout experience moves from engines to trainer ranks."""

    _target_: str = MISSING

    def largest_micro_batch(self, micro_batch_size: int, max_seq_len: int) -> tuple[int, bool]:
        """(tokens of the largest micro-batch a trainer rank runs, whether it is a padded rectangle);
        the memory plan sizes activations with it."""
        return micro_batch_size * max_seq_len, True


@dataclass
class PaddedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.padded.PaddedTransfer"


@dataclass
class PackedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.packed.PackedTransfer"
    # Tokens per packed micro-batch; 0 = derive from micro_batch_size * max_len.
    token_budget: int = 0

    def largest_micro_batch(self, micro_batch_size: int, max_seq_len: int) -> tuple[int, bool]:
        # A sequence longer than the budget still travels, alone in its row.
        return max(self.token_budget or micro_batch_size * max_seq_len, max_seq_len), False


@dataclass
class MicroBatchedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.micro_batched.MicroBatchedTransfer"
    # Bound on micro-batches handed over but not yet staged on the trainers.
    max_in_flight: int = 4


# --------------------------------------------------------------------------- pipeline
@dataclass
class PipelineConfig:
    """When a step's rollout is generated relative to the weights that train on it
    (`rlhf_orch.orchestration.pipeline`): `sync` (on-policy, one phase after the other) or
    `one_step_off` (the next rollout is generated while the trainers train, one version behind)
    or `async` (`AsyncPipelineConfig`)."""

    _target_: str = MISSING


@dataclass
class AsyncPipelineConfig(PipelineConfig):
    """`pipeline=async`: rollouts generate ahead of the trainers, several at once, and take new
    weights mid-generation."""

    # eta: no sequence trains on weights more than this many versions newer than those that drew
    # its first token (AReaL's bound); the engines run up to eta + 1 rollouts ahead. 0 = sync.
    max_staleness: int = 1
    # A weight update reaches the sequences in flight (true: they go on with the new weights from
    # where they are, no token drawn again) or waits until they finish (false).
    partial_rollout: bool = True


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
    """A prompt source (`rlhf_orch.data.base.PromptSource`)."""

    _target_: str = MISSING
    prompt_max_len: int = 32  # tokens
    response_max_len: int = 16  # tokens generated at most
    seed: int = II("seed")  # the order prompts are drawn in; the run's `seed` unless set here

    def raw_prompts(self) -> Optional[str]:
        """Why this option's prompts are not the tokenizer's chat template's rendering of their
        messages (what observations rendered by the template continue), or None when they are.
        The embedded tasks' prompts are raw text (`rev 3 1 4 =`)."""
        return f"data {self._target_.rsplit('.', 1)[-1]} gives raw-text prompts"


@dataclass
class DigitTaskConfig(DataConfig):
    """The embedded verifiable task (see rlhf_orch.data.digit_task)."""

    _target_: str = "rlhf_orch.data.digit_task.DigitReverseTask"
    min_digits: int = 3
    max_digits: int = 5
    filler_tokens: int = 0  # extra context tokens in front of the task (for long-context runs)
    # A long tail of response lengths (pipeline benchmarks): this fraction of training prompts must
    # be answered with at least long_tail_len tokens (EOS suppressed until then). 0 = off.
    long_tail_frac: float = 0.0
    long_tail_len: int = 0
    eval_size: int = 64  # held-out prompts (their own random stream) for evaluation


@dataclass
class LookupTaskConfig(DigitTaskConfig):
    """The embedded tool-use task: the answer is a record's value only the lookup tool returns
    (rlhf_orch.data.lookup_task; with env=lookup and model=tiny_tool)."""

    _target_: str = "rlhf_orch.data.lookup_task.LookupTask"
    # One length: the copy is then a fixed offset back, which a 2-layer model learns in a short
    # warm start (with 3-4 digits it stayed at chance after 300 steps).
    min_digits: int = 3
    max_digits: int = 3
    response_max_len: int = 24  # call + EOS, the tool's answer, the value + EOS


@dataclass
class FilesDataConfig(DataConfig):
    """Prompts from local files (.jsonl, .json, .parquet) or hub datasets (`hf:<name>[:<config>]@<split>`).

    The default column mapping is veRL's parquet layout; OpenRLHF's jsonl takes
    `data.prompt_key=<input key> data.label_key=<label key>`.
    """

    _target_: str = "rlhf_orch.data.files.PromptDataset"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: Optional[str] = "prompt"  # a plain string column or a chat-messages column
    label_key: Optional[str] = "reward_model.ground_truth"  # dots read nested fields
    label_regex: Optional[str] = None  # label = first group of this regex in the label column
    label_columns: Optional[list[str]] = None  # label = {column: value} of these columns instead
    source_key: str = "data_source"
    default_source: str = "default"  # when the source column is absent
    extra_key: str = "extra_info"
    chat_template: bool = True
    prompt_template: Optional[str] = None  # with {prompt} (and any column as {column})
    system_prompt: Optional[str] = None
    overlong: str = "error"  # "error" or "filter"
    shuffle: bool = True
    prompt_max_len: int = 512
    response_max_len: int = 512

    def raw_prompts(self) -> Optional[str]:
        return None if self.chat_template else "data.chat_template=false renders the prompts as plain text"


@dataclass
class ReasoningGymDataConfig(DataConfig):
    """Procedural reasoning tasks from reasoning-gym, scored by the dataset's own verifier
    (rlhf_orch.data.reasoning_gym_task; reward=reasoning_gym)."""

    _target_: str = "rlhf_orch.data.reasoning_gym_task.ReasoningGymTask"
    task: str = MISSING  # a reasoning-gym dataset name: basic_arithmetic, chain_sum, countdown, ...
    task_config: dict[str, Any] = field(default_factory=dict)  # the dataset's own options
    size: int = 100_000  # training entries (generated on demand; the epoch length)
    eval_size: int = 64  # held-out entries (their own seed; never trained on)
    # A name of reasoning-gym's SYSTEM_PROMPTS (default, direct, simple, DeepSeekZero, chain_of_draft),
    # any other text as is, or null for none.
    system_prompt: Optional[str] = "default"
    chat_template: bool = True
    few_shot: int = 0  # solved examples (earlier user/assistant turns) before each question
    prompt_max_len: int = 256
    response_max_len: int = 256

    def raw_prompts(self) -> Optional[str]:
        return None if self.chat_template else "data.chat_template=false renders the prompts as plain text"


# --------------------------------------------------------------------------- reward
@dataclass
class RewardConfig:
    """How responses are scored (`rlhf_orch.reward`): a function (rule) or a reward model."""

    _target_: str = MISSING

    scores_after_handover: ClassVar[bool] = False


@dataclass
class RuleRewardConfig(RewardConfig):
    """A scoring function, run where the samples are (engines).

    `timeout_s` and `pool_size` say how the rule runs (not the rule's own arguments): a sample
    taking longer than `timeout_s` scores 0 and is counted; `pool_size > 0` scores in that many
    Ray tasks instead of inline on the engine.
    """

    timeout_s: float = 10.0
    pool_size: int = 0

    execution_keys: ClassVar[tuple[str, ...]] = ("timeout_s", "pool_size")


@dataclass
class DigitRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.DigitReverseRule"


@dataclass
class GSM8KRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.GSM8KRule"
    method: str = "strict"  # "strict" (#### extraction, as veRL scores) or "flexible" (last number)
    format_score: float = 0.0
    score: float = 1.0


@dataclass
class MathVerifyRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.MathVerifyRule"


@dataclass
class CountdownRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.CountdownRule"
    format_score: float = 0.1
    score: float = 1.0


@dataclass
class ReasoningGymRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.reasoning_gym_rule.ReasoningGymRule"
    # false: only a full score counts (1.0), every partial one is 0 -- e.g. basic_arithmetic's credit for
    # the right number inside a longer answer ("19.10" for 19 scores 0.4), which a policy can learn to farm.
    partial_credit: bool = True


@dataclass
class CustomRewardConfig(RuleRewardConfig):
    """A user's function: veRL's `compute_score(data_source, solution_str, ground_truth, extra_info)`."""

    _target_: str = "rlhf_orch.reward.custom.CustomReward"
    path: str = MISSING
    name: str = "compute_score"
    # One call with lists for the whole batch, inline on the engine (so reward.pool_size must be 0);
    # reward.timeout_s x the batch's size limits that call, and a timeout or an exception scores it all 0.
    batched: bool = False


@dataclass
class ModelRewardConfig(RewardConfig):
    """A sequence-classification reward model in its own Ray actor(s), placed by the planner.

    `model_path: null` builds the tiny reward model locally (CPU tests). A rule can be added with
    `+reward@reward.rule=<rule option>`; the score is `weight * model + rule_weight * rule`. It has
    no timeout_s / pool_size of its own: its forward passes are waits of the step
    (fault.step_timeout_s); an added rule has its own (`reward.rule.timeout_s`, `reward.rule.pool_size`).
    """

    _target_: str = "rlhf_orch.reward.model.RewardModel"
    model_path: Optional[str] = None
    weight: float = 1.0
    rule: Optional[Any] = None
    rule_weight: float = 1.0
    micro_batch_size: int = 16

    scores_after_handover: ClassVar[bool] = True  # known only once its ranks hold the sequences


# --------------------------------------------------------------------------- env
@dataclass
class EnvConfig:
    """What a rollout is (`rlhf_orch.env`): one response, or a multi-turn trajectory."""

    _target_: str = MISSING

    # Its observations continue the chat template's rendering of the prompt (multi-turn options
    # with observation_format=chat_template).
    continues_chat_template: ClassVar[bool] = False


@dataclass
class SingleTurnEnvConfig(EnvConfig):
    _target_: str = "rlhf_orch.env.single_turn.SingleTurn"


@dataclass
class MultiTurnEnvConfig(EnvConfig):
    """A trajectory: the policy writes, the environment answers, until done or a limit. The whole
    trajectory lives within data.response_max_len tokens."""

    max_turns: int = 4  # model turns per trajectory
    max_tokens_per_turn: Optional[int] = None  # null = the whole data.response_max_len
    max_observation_tokens: int = 256  # longer observations are cut (counted: env/observations_truncated)
    tool_timeout_s: float = 10.0  # one env.step (a tool call) longer than this ends the trajectory, counted
    concurrency: int = 16  # trajectories in flight per engine
    # "last": the last step's reward; "sum": every step's; "per_turn": every step's, each on its turn's
    # last token (for PPO / REINFORCE++, whose advantages read rewards per token)
    reward: str = "last"
    reward_weight: float = 0.0  # + this x the reward group's score of the transcript (0: the environment's alone)
    observation_format: str = "chat_template"  # or "plain" (models whose template renders no tool/user turns)
    # Which part of a too-long observation's content is cut (tail / head / middle); the template's
    # own tokens around it are never cut.
    observation_truncate_side: str = "tail"
    # The context of every trajectory against the chat template's rendering of its conversation
    # (veRL's tokenization sanity check): strict (a mismatch ends the run), warn, off; null: strict
    # with observation_format=chat_template, off with plain (no template to check against).
    tokenization_sanity_check_mode: Optional[str] = None
    stop: list[str] = field(default_factory=list)  # strings that end a turn (kept); the end-of-turn token follows
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    mask_failed: bool = False  # train nothing of a trajectory whose env.step raised or timed out (else: its reward)
    mask_truncated: bool = False  # train nothing of a trajectory cut by a limit (turns, tokens)

    # The environment can reward a turn before the last (env.reward=per_turn then places it there);
    # an option that rewards only its final answer makes per_turn the same as sum.
    rewards_each_turn: ClassVar[bool] = True

    @property
    def continues_chat_template(self) -> bool:
        """Its observations are the chat template's text after a turn: the prompt they follow must be
        the template's rendering too."""
        return self.observation_format == "chat_template"


@dataclass
class CustomEnvConfig(MultiTurnEnvConfig):
    """A user's class with skyrl-gym's BaseTextEnv contract: env.path=<file.py> env.name=<class>."""

    _target_: str = "rlhf_orch.env.custom.CustomEnv"
    path: str = MISSING
    name: str = MISSING
    env_config: dict[str, Any] = field(default_factory=dict)  # passed to the class as env_config


@dataclass
class SkyRLEnvConfig(MultiTurnEnvConfig):
    """A skyrl-gym environment from the installed package: env.env_class=<registered id>."""

    _target_: str = "rlhf_orch.env.skyrl.SkyRLEnv"
    env_class: str = ""  # "" = each row's env_class column
    env_config: dict[str, Any] = field(default_factory=dict)
    # Run skyrl-gym environments that execute the model's code themselves (lcb, searchcode), chosen by
    # env.env_class or by the rows' env_class: in the engine's process, with its environment, network
    # and files, outside rlhf_orch's sandbox; refused before anything starts otherwise. The
    # counterpart of env=python_tool's env.allow_weak_sandbox (which sandboxes the model's code).
    allow_unsandboxed_code: bool = False


@dataclass
class LookupEnvConfig(MultiTurnEnvConfig):
    """The embedded tool-use task's lookup tool (data=lookup, model=tiny_tool)."""

    _target_: str = "rlhf_orch.env.lookup.LookupEnv"
    max_turns: int = 3
    observation_format: str = "plain"

    rewards_each_turn: ClassVar[bool] = False  # a tool call scores 0; the answer is scored



@dataclass
class PythonToolEnvConfig(MultiTurnEnvConfig):
    """The project's tool-calling environment: a sandboxed Python tool (rlhf_orch.env.python_tool)."""

    _target_: str = "rlhf_orch.env.python_tool.PythonToolEnv"
    # "hermes": <tool_call>{json}</tool_call>; "tags": <python>code</python>; or a vLLM tool parser's name
    tool_format: str = "hermes"
    tool_memory_mb: int = 512
    tool_cpu_s: int = 5
    tool_max_output_bytes: int = 2000
    # Run model-written code where the sandbox lacks a boundary (network namespace, private read-only
    # filesystem, separate uid: a host without namespaces, e.g. a default Docker container); refused otherwise.
    allow_weak_sandbox: bool = False

    rewards_each_turn: ClassVar[bool] = False  # a tool call scores 0; the final answer is scored


@dataclass
class AgentEnvConfig(EnvConfig):
    """An agent program calling the run's OpenAI-compatible endpoint: env.path=<file.py> env.name=<function>."""

    _target_: str = "rlhf_orch.env.agent.AgentEnv"
    path: str = MISSING
    name: str = MISSING
    max_tokens_per_turn: Optional[int] = None  # per call; null = the whole data.response_max_len
    max_calls: int = 16  # chat-completions calls per trajectory; later ones are refused (HTTP 400)
    concurrency: int = 16  # agent functions running at once per engine
    timeout_s: float = 120.0  # one agent function, calls included; past it: reward 0, counted
    host: str = "auto"  # where the endpoint listens: auto / loopback (127.0.0.1: the agents run in processes the engine starts), node
    served_model_name: str = "policy"  # the model name agents must ask for (GET /v1/models)
    tool_parser: str = "hermes"  # "hermes": <tool_call>{json}</tool_call> -> tool_calls; "none"; or a vLLM tool parser
    reasoning_parser: str = "none"  # a vLLM reasoning parser (qwen3, deepseek_r1): <think> -> reasoning_content


# --------------------------------------------------------------------------- model
@dataclass
class LoraConfig:
    """model.lora: the policy trains LoRA adapters on the frozen base (`peft`); rank 0 = off (full
    fine-tuning). rlhf_orch.models.lora says what each key does and how the engines get the adapter."""

    _target_: str = "rlhf_orch.models.lora.LoraSettings"
    rank: int = 0  # adapter rank; 0 = full fine-tuning
    alpha: Optional[float] = None  # the update is alpha / rank * B @ A; null = 4 x rank (docs/lora.md)
    dropout: float = 0.0  # on the adapters' input, training forwards only
    target_modules: Any = "all-linear"  # PEFT's: "all-linear" or a list of module names (q_proj, ...)
    sync: str = "auto"  # what each weight sync moves: adapter (its tensors only), merged (every weight), auto


@dataclass
class ModelConfig:
    _target_: str = MISSING
    context_len: int = 2048  # max_position_embeddings the engines and trainers may use
    dtype: str = "float32"  # "float32" on CPU, "bfloat16" on GPUs
    lora: LoraConfig = field(default_factory=LoraConfig)


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
    # What it is warm-started on: the digit task, or the lookup tool task (model=tiny_tool).
    warm_start: str = "digit_reverse"
    cache_dir: str = "${oc.env:RLHF_ORCH_CACHE,${oc.env:HOME}/.cache/rlhf_orch}"


@dataclass
class HFModelConfig(ModelConfig):
    """A Hugging Face checkpoint (GPU clusters)."""

    _target_: str = "rlhf_orch.models.hf.HFModel"
    name_or_path: str = MISSING
    dtype: str = "bfloat16"


@dataclass
class PackagedGGUFModelConfig(ModelConfig):
    """A real model shipped as a GGUF file inside a Python package (installed with --no-deps, never
    imported), dequantized once into a float32 Hugging Face checkpoint in the model cache."""

    _target_: str = "rlhf_orch.models.gguf.PackagedGGUFModel"
    distribution: str = MISSING  # the package (pip name) that ships the file
    version: str = MISSING  # its pinned version (part of the cache key)
    gguf_file: str = MISSING  # the file's path inside the installed package
    cache_dir: str = "${oc.env:RLHF_ORCH_CACHE,${oc.env:HOME}/.cache/rlhf_orch}"


# --------------------------------------------------------------------------- algo
# The values algo.loss_agg and algo.kl_estimator take (rlhf_orch.algo.losses implements each).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_DIVERGENCE_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")

@dataclass
class AlgoConfig:
    """The RL algorithm: the schedule every option shares, the policy loss, the KL term.

    Each option's `_target_` is a class in `rlhf_orch.algo.estimators` that extends its schema
    below (so the built object carries these fields and adds the math). The ClassVars say what the
    algorithm needs (`validate`, the planner and the loop ask, never check names).
    """

    _target_: str = MISSING
    num_steps: int = 100
    rollout_batch_size: int = 32  # prompts per step
    samples_per_prompt: int = 4
    train_batch_size: int = 64  # sequences per optimizer step (global)
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    ppo_epochs: int = 1  # passes over the rollout; micro-batches reshuffled between passes
    actor_lr: float = 1e-4
    temperature: float = 1.0  # sampling temperature of the rollout (and of the trainer's logprobs)
    # Tokens every rollout response has at least: EOS cannot end it before (vLLM's min_tokens); 0 = off.
    # Makes every response long, e.g. for benchmarks of generation-heavy settings (scripts/bench_peers.py).
    min_response_len: int = 0
    grad_clip: float = 1.0
    # Policy loss: PPO's clipped surrogate with a decoupled range [1 - clip_low, 1 + clip_high].
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip PPO: a token with A < 0 loses at most -A * clip_ratio_c (> 1; veRL/OpenRLHF use 3). null = off.
    clip_ratio_c: Optional[float] = None
    # "token-mean", "seq-mean-token-sum", "seq-mean-token-mean" or "seq-mean-token-sum-norm".
    loss_agg: str = "token-mean"
    loss_agg_norm_len: int = 0  # seq-mean-token-sum-norm's constant; 0 = data.response_max_len
    entropy_coef: float = 0.0
    # KL to the reference: "in_reward" (a per-token penalty in the reward; k1 or k2) or "in_loss"
    # (a loss term; k1, k2 or low_var_kl/k3) or "off". k3 in the reward is refused: its gradient
    # there is biased (it is an estimator of the KL's value, not of its gradient).
    kl_placement: str = "in_reward"
    kl_coef: float = 0.01
    kl_estimator: str = "k1"
    # Truncated importance sampling: each token's policy loss is weighted by
    # min(pi_old / pi_engine, tis_cap), pi_engine being the log-probs the engine sampled with
    # (stale weights under pipeline=one_step_off, other kernels always). null = off.
    tis_cap: Optional[float] = None
    # AReaL's decoupled PPO (Fu et al. 2025): the clip stays against pi_old (the proximal policy)
    # and each token's loss is weighted by pi_old / pi_engine; a token whose weight exceeds
    # decoupled_is_cap is dropped from the loss (weight 0), where tis_cap would truncate it.
    # > 1 (AReaL's behav_imp_weight_cap, 5 in its examples); not with tis_cap. null = off.
    decoupled_is_cap: Optional[float] = None

    needs_critic: ClassVar[bool] = False
    group_estimator: ClassVar[bool] = False  # advantages compare the samples of one prompt
    # Advantages read rewards per token (GAE, a return-to-go), so env.reward=per_turn changes them;
    # outcome estimators judge a trajectory by one score (per-turn rewards would be their sum).
    per_token_rewards: ClassVar[bool] = False

    # Derived (not keys): what the KL settings ask of the run.
    @property
    def kl_in_reward(self) -> bool:
        return self.kl_placement == "in_reward" and self.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_placement == "in_loss" and self.kl_coef > 0

    @property
    def needs_reference(self) -> bool:
        """A reference model is placed and run only when a KL term uses it."""
        return self.kl_in_reward or self.kl_in_loss

    @property
    def compares_group_samples(self) -> bool:
        """Each sample is judged against the other samples of its prompt (a group of one has none)."""
        return self.group_estimator


@dataclass
class PPOConfig(AlgoConfig):
    """PPO with a learned critic: GAE over KL-shaped token rewards."""

    _target_: str = "rlhf_orch.algo.estimators.PPO"
    critic_lr: float = 5e-4
    gamma: float = 1.0
    lam: float = 0.95
    value_clip_eps: float = 0.2
    whiten_advantages: bool = True  # over the global batch (all data-parallel ranks)

    needs_critic: ClassVar[bool] = True
    per_token_rewards: ClassVar[bool] = True


@dataclass
class GRPOConfig(AlgoConfig):
    """GRPO: outcome advantages relative to the prompt's group; norm_by_std=false is Dr. GRPO."""

    _target_: str = "rlhf_orch.algo.estimators.GRPO"
    norm_by_std: bool = True
    eps: float = 1e-6
    kl_placement: str = "in_loss"
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"

    group_estimator: ClassVar[bool] = True


@dataclass
class RLOOConfig(AlgoConfig):
    """RLOO: each sample's baseline is the mean reward of the other samples of its prompt."""

    _target_: str = "rlhf_orch.algo.estimators.RLOO"
    kl_placement: str = "in_loss"
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"

    group_estimator: ClassVar[bool] = True


@dataclass
class ReinforcePPConfig(AlgoConfig):
    """REINFORCE++: discounted return-to-go of KL-shaped rewards, normalised over the global batch."""

    _target_: str = "rlhf_orch.algo.estimators.ReinforcePP"
    gamma: float = 1.0
    group_baseline: bool = False  # reinforce_pp_baseline: subtract the prompt group's mean score first

    per_token_rewards: ClassVar[bool] = True

    @property
    def compares_group_samples(self) -> bool:
        return self.group_baseline


@dataclass
class DAPOConfig(GRPOConfig):
    """DAPO: GRPO with clip-higher, token-mean loss, no KL, dynamic sampling and overlong shaping."""

    _target_: str = "rlhf_orch.algo.estimators.DAPO"
    clip_high: float = 0.28
    kl_placement: str = "off"
    kl_coef: float = 0.0
    dynamic_sampling: bool = True
    max_gen_batches: int = 4  # rollout rounds per step at most to fill the batch with informative groups
    overlong_buffer: int = 0  # tokens before data.response_max_len where the penalty ramps in (0: off)
    overlong_penalty: float = 1.0


# --------------------------------------------------------------------------- evaluation
@dataclass
class EvalConfig:
    """Held-out evaluation on the engines with the current weights, scored by the run's reward."""

    every_n_steps: int = 0  # 0 = off
    before_train: bool = False
    num_prompts: int = 0  # 0 = the whole validation set
    samples_per_prompt: int = 1  # k of mean@k / pass@k
    temperature: float = 0.0  # 0 = greedy
    pass_threshold: float = 1.0  # a sample "passes" when its score reaches this

    # Derived (not a key): whether the run evaluates at all (the driver, the engines' KV cache and
    # the memory plan all ask).
    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0 or self.before_train


# --------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    """DeepSpeed settings shared by actor and critic."""

    zero_stage: int = 0
    # Optimizer states, fp32 master weights and gradients in host memory (DeepSpeed ZeRO-Offload):
    # GPU memory for slower steps. GPU layouts only (on CPU they are in host memory already).
    offload_optimizer: bool = False
    # Recompute each layer's activations in the backward pass instead of keeping them (HF's
    # gradient checkpointing): activation memory ~1/layers for ~30 % more trainer compute.
    gradient_checkpointing: bool = False
    # How each rank holds the KL reference: "full" (a whole copy per reference rank), "sharded"
    # (DeepSpeed ZeRO-3 over the reference ranks -- the policy ranks when it lives in their
    # processes: 1/ranks of the weights each, a layer gathered at a time), "offloaded" (sharded, the
    # shards in host memory; GPU layouts). What a policy too large for a whole reference per GPU needs.
    reference_memory: str = "full"
    # A packed micro-batch's samples of one prompt (GRPO's group) run it once: each response attends
    # to the one copy (rlhf_orch.trainer.shared_prompts; same log-probs, values and gradients).
    # null = on with transfer=packed (padded micro-batches keep a row per sequence); false = off.
    # Where the trainers load flash-attention's varlen kernels (CUDA with flash_attn) it is off:
    # they take whole sequences only. On CUDA the row's attention is two padded SDPA calls a layer,
    # used where the row is at least 25 % shorter (else the plain row runs; measured on an H200);
    # on CPU one call per branch, used at any saving. Exact with attention dropout 0 (the branches
    # would share the prompt's dropout mask otherwise).
    share_prompts: Optional[bool] = None
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # "adamw" (betas 0.9, 0.95) or "sgd" (plain: the update is lr x gradient)
    # Torch threads of each trainer process (actor, critic, reference, reward model). On CPU, Ray gives
    # an actor one core; under pipeline=sync the engine waits while the trainers train, so a
    # trainer may use that core too (2 on a 2-core machine: SmolLM2's training phase 1.8x faster).
    torch_threads: int = 1
    seed: int = II("seed")  # the trainers' torch/NumPy/Python RNG (dropout, init); the run's `seed` unless set here


# --------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    """vLLM engine settings."""

    # KV cache of one engine (per GPU of it, per worker of a CPU engine), GiB: vLLM's
    # kv_cache_memory_bytes, which replaces gpu_memory_utilization (leave that null). null: on GPUs
    # vLLM sizes the cache from gpu_memory_utilization; on CPU it holds every sequence the engine
    # generates at once at full length, with headroom (rlhf_orch.engines.launch.cpu_kv_cache_bytes).
    kv_cache_gb: Optional[float] = None
    # Fraction of each engine GPU's memory vLLM may take; null = the engine's planned GPU share
    # (placement.engine_fraction when colocated, 0.9 on GPUs of its own). Validated against the plan.
    gpu_memory_utilization: Optional[float] = None
    # vLLM sleep level between a rollout and the next weight sync (frees GPU memory for training):
    # 0 off, 1 weights to CPU + KV cache dropped, 2 weights and KV cache dropped (re-sent by the sync);
    # null = 1 for colocated GPU layouts, 0 otherwise (docs/gpu.md).
    sleep_level: Optional[int] = None
    enable_prefix_caching: bool = True
    # Tokens per KV-cache block; prefix caching shares whole blocks only. null = 32 on CPU engines
    # (vLLM's CPU default, 128, is longer than most prompts: a GRPO group's samples then recompute
    # their shared prompt -- measured on SmolLM2 with 102-token prompts, 4 x 8 samples of 16
    # tokens: 3.84 s a rollout at 128, 1.51 s at 32; docs/benchmarks.md), vLLM's default on GPUs.
    block_size: Optional[int] = None
    enforce_eager: bool = True


# --------------------------------------------------------------------------- checkpoint
@dataclass
class CheckpointConfig:
    """What a run keeps so it can continue (`resume=`) and what it exports (rlhf_orch.checkpoint)."""

    every_n_steps: int = 0  # 0 = no periodic checkpoints (the end of the run and signals still write one)
    # Also a checkpoint after the first step that ends this long after the last one (or the start):
    # a crash loses at most about this much work. 0 = off.
    every_n_minutes: float = 30.0
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted (>= 1)
    dir: Optional[str] = None  # null = <run dir>/checkpoints; must be shared by every node of a cluster
    on_signal: bool = True  # SIGINT/SIGTERM: finish the step, write a checkpoint, then stop
    at_end: bool = True  # a checkpoint after the last step (so a longer num_steps can resume it)
    export_hf: bool = False  # also export the policy in Hugging Face format at every checkpoint
    export_final: bool = True  # export the policy in Hugging Face format at the end of the run
    # Seconds writing one checkpoint (every role's DeepSpeed state) or one Hugging Face export may
    # take: a large ZeRO-3 save can outlast fault.step_timeout_s without anything being dead.
    timeout_s: float = 3600.0


# --------------------------------------------------------------------------- failures
@dataclass
class FaultConfig:
    """How a run reacts to failures it can survive."""

    # Engines replaced in their bundle per invocation at most (a resumed run starts with it whole;
    # an engine left stuck in a broadcast a dead one broke is replaced with it at no charge); 0 = none.
    max_engine_restarts: int = 3
    # Liveness by progress: the window of a wait on actors. A rollout's engines (generating,
    # scoring: engine steps and scored samples) and a trainer phase's ranks (experience, reward-model
    # scoring, the update: micro-batches, decoder layers, collectives) are waited for as long as
    # their counts move, looked at every step_timeout_s; a stuck one (its count standing between
    # two looks, or no answer) is found within two windows, however long the healthy phase. Any
    # other wait on an actor within a step (a hand-over, seeding an engine) gets one window.
    step_timeout_s: float = 600.0
    # Whole-run restarts per invocation when a process the run cannot continue without (a trainer
    # rank; under sync / one_step_off an engine lost outside generation) died or stopped answering:
    # every role starts again in its bundles from the last checkpoint (the initial weights without
    # one) and the run goes on. 0 = none.
    max_trainer_restarts: int = 2


# --------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    _target_: str = MISSING
    plot_every_n_steps: int = 0  # refresh <run dir>/plots every n steps (0 = only when the run ends)
    verbose: bool = False  # Ray/vLLM/DeepSpeed output on the console too (otherwise only in the run dir)
    # What the model wrote: <run dir>/rollouts/step_<N>.jsonl, the whole sequence decoded (special
    # tokens kept), prompt, response, reward, advantage, turns, data source (rlhf_orch.logging.rollout_dump).
    rollouts: bool = True
    rollouts_per_step: int = 16  # sequences written per step (the lowest indices: whole prompt groups)


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
    dry_run: bool = False  # print the placement plan and the memory plan, and exit without starting actors
    # A run whose memory plan does not fit: "refuse" (exit 2, before Ray starts) or "warn" (say so, run).
    memory_check: str = "refuse"
    # Fraction of each device (GPU, host) the memory plan keeps free for what it does not model:
    # a trainer on an H100 held up to 1.4 % more than planned (allocator reserve with expandable
    # segments, scripts/bench_memory.py --gpu); vLLM on a GPU and NCCL are stated, not measured.
    memory_margin: float = 0.05
    # Ray logical GPUs to declare when the machine has none (CPU testing of GPU layouts).
    logical_gpus: int = 0
    num_cpus: Optional[int] = None
    address: Optional[str] = None
    startup_timeout_s: float = 600.0
    # true: run inside the Ray session this process already has (a notebook, the test suite, runs
    # started one after another from a script) and leave it up for the next; false: the run owns its
    # Ray connection (local: starts Ray) and ends it. Either way the run removes its actors.
    reuse_session: bool = False
    # true (needs reuse_session=true): a run that completes with every actor answering leaves its
    # engines and trainer processes up, and the next run of this process on the same placement plan
    # resets and uses them instead of starting new ones (~12 CPU-s an engine, ~7 a trainer rank
    # saved; rlhf_orch.orchestration.warm_actors). Their resources stay claimed between runs.
    keep_actors: bool = False


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
    pipeline: PipelineConfig = MISSING
    transfer: TransferConfig = MISSING
    sync: SyncConfig = MISSING
    data: DataConfig = MISSING
    reward: RewardConfig = MISSING
    env: EnvConfig = MISSING
    model: ModelConfig = MISSING
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
    "placement": {"cpu_local": CpuLocalPlacementConfig, "colocated": ColocatedPlacementConfig, "split": SplitPlacementConfig},
    "pipeline": {"base": PipelineConfig, "async": AsyncPipelineConfig},
    "transfer": {"padded": PaddedTransferConfig, "packed": PackedTransferConfig, "micro_batched": MicroBatchedTransferConfig},
    "sync": {
        "per_tensor": PerTensorSyncConfig,
        "bucketed": BucketedSyncConfig,
        "multi_sender": MultiSenderSyncConfig,
        "object_store": ObjectStoreSyncConfig,
        "cuda_ipc": CudaIpcSyncConfig,
    },
    "data": {"digit_task": DigitTaskConfig, "lookup_task": LookupTaskConfig, "files": FilesDataConfig,
             "reasoning_gym": ReasoningGymDataConfig},
    "reward": {
        "digit_rule": DigitRuleConfig,
        "gsm8k": GSM8KRuleConfig,
        "math_verify": MathVerifyRuleConfig,
        "countdown": CountdownRuleConfig,
        "reasoning_gym": ReasoningGymRuleConfig,
        "custom": CustomRewardConfig,
        "model": ModelRewardConfig,
    },
    "env": {"single_turn": SingleTurnEnvConfig, "custom": CustomEnvConfig, "skyrl": SkyRLEnvConfig, "python_tool": PythonToolEnvConfig,
            "lookup": LookupEnvConfig, "agent": AgentEnvConfig},
    "model": {"tiny": TinyModelConfig, "hf": HFModelConfig, "packaged_gguf": PackagedGGUFModelConfig},
    "algo": {"ppo": PPOConfig, "grpo": GRPOConfig, "rloo": RLOOConfig, "reinforce_pp": ReinforcePPConfig, "dapo": DAPOConfig},
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
