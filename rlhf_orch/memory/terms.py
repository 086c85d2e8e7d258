"""What one process of one role holds in memory, term by term: pure arithmetic on the model's shape
and the run's settings (no torch, no Ray).

Each term is tagged with the phase of a step it is held in: `always` (weights, optimizer states,
the process's runtime), `train` (activations and logits of the actor's and critic's forward/backward,
which run at the same time), `experience` (the forward-only logits of old and reference logprobs) or
`generate` (an engine's weights and KV cache, which a sleeping engine gives back while the trainers
work).

The formulas, per role (N = parameters, w = bytes per element of the model dtype, dp = data-parallel
ranks of the role, T = tokens of the largest micro-batch, L layers, h hidden, I intermediate, V vocab):
  * weights        N*w, divided by dp under ZeRO-3 (a role of one rank runs ZeRO-1/2 as stage 0:
    `rlhf_orch.trainer.deepspeed_config.zero_stage_to_run`)
  * gradients      N*w (+ N*4 fp32 accumulation when w < 4), divided by dp from ZeRO-2 (whose reduce
    bucket of up to 5e8 elements and, at ZeRO-2, a partition in the model's dtype come on top)
  * master weights N*4 when w < 4 (mixed precision), divided by dp from ZeRO-1
  * optimizer      AdamW: 8*N (two fp32 moments), divided by dp from ZeRO-1; plain SGD: 0
    (offloaded optimizer states and master weights live in host memory, not on the GPU)
  * activations    T * per-token-per-layer * L saved for backward; with gradient checkpointing only
    each layer's input (T*h*w*L) plus one layer's full activations; padded batches on CPU add the
    attention scores sdpa's math kernel materialises (sequences * heads * s^2 * 4 per layer)
  * logits         T*V*2w in training: the logits (the log-probs' backward keeps them and one float
    per row: `algo.vocab_reductions`) and their gradient; T*V*w in a forward without gradients
    (old and reference logprobs)
  * entropy        T*V*w in training when algo.entropy_coef > 0: the entropy's gradient of the
    logits until autograd adds it to the log-probs' (its backward keeps no [T, V] copy either)
  * old log-probs  the actor's own forward without gradients in the experience phase: T*V*w logits
    and one layer's transient tensors (as the reference's forward)
  * sync buffers   the sending policy rank's bucketed weight sync packs two buckets of
    sync.bucket_mb in flight (every policy rank under a multi-sender sync), in the generate phase:
    on a GPU in its memory, on a CPU layout in host memory, allocated for each sync (at most the weights)
  * nccl buffers   on a GPU, NCCL's channel buffers per communicator a process belongs to (the
    trainers' data-parallel world, the weight-sync group, a tensor-parallel engine's group)
  * allocator      on a GPU, what torch's caching allocator reserves above what a trainer holds when
    it keeps the default allocator (cuda_ipc senders): 31 % of each phase's planned tensors, in that
    phase (what the H100 and H200 runs measured beyond the plan at the training peak,
    `DEFAULT_ALLOCATOR_RESERVE`; a trainer sharing its GPU empties its cache as each phase ends)
  * engine         weights N*w/tp, KV cache (engine.kv_cache_gb, or what gpu_memory_utilization
    leaves), a forward workspace, CUDA graphs unless enforce_eager; on CPU also vLLM's re-packed
    copy of the linear weights and the sync's two receive buffers (while a sync runs)
  * checkpoint load (CPU) the checkpoint's memory-mapped file pages, read while loading
  * runtime        what the process holds besides tensors (interpreter, torch, vLLM/DeepSpeed,
    CUDA context); measured on this machine's CPU processes (scripts/bench_memory.py); on a GPU the
    trainer's measured on an H100 (scripts/bench/bench_gpu.py), the others stated
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf_orch.engines.launch import cpu_kv_cache_bytes
from rlhf_orch.memory.shapes import ModelShape
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.models.options import LoraConfig
from rlhf_orch.topology.options import PlacementConfig
from rlhf_orch.trainer.deepspeed_config import zero_stage_to_run
from rlhf_orch.trainer.options import TrainerConfig

GiB = 2**30
# Bytes per logit that the log-probs' and the entropy's backward keep beyond the logits themselves:
# a few floats per row only (`algo.vocab_reductions`; tests/memory/test_memory_plan.py measures it with torch's
# saved-tensors hooks). Written plainly with autograd they kept 4 and 17.
VOCAB_REDUCTION_SAVED_BYTES_PER_ELEMENT = 0
ALWAYS, TRAIN, EXPERIENCE, GENERATE = "always", "train", "experience", "generate"
PHASES = (TRAIN, EXPERIENCE, GENERATE)

BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}

# Resident memory of a role process before it holds any model (imports, allocator, libraries),
# measured as the RSS high-water mark of tiny-model runs on this machine's CPU (scripts/bench_memory.py):
# (anonymous memory, file-backed pages of the shared libraries). The driver row is run.py plus Ray's
# raylet, GCS, dashboard and idle workers.
# Re-measured 2026-11-27 (vLLM 0.32, torch 2.13, Ray 2.60): the trainer, engine and driver rows had
# grown by 0.08, 0.17 and 0.15 GB since the first calibration (2026-11-25: 0.52, 0.63, 1.1).
CPU_RUNTIME_BYTES = {
    "trainer": (int(0.60e9), int(0.16e9)),
    "forward": (int(0.42e9), int(0.16e9)),
    "engine": (int(0.80e9), int(0.24e9)),
    "driver": (int(1.25e9), int(0.4e9)),
}
# On a GPU: the CUDA context, cuBLAS/NCCL workspaces and what DeepSpeed allocates outside torch's
# caching allocator, per process (nvidia-smi's figure less torch's reserve). The trainer's were measured
# on an H100 (scripts/bench/bench_gpu.py, 2026-11-27: 1.39 GB at ZeRO-0..2, 0.41 GB more at ZeRO-3); the
# forward-only and engine rows are not measured yet (the lent GPU machine had no vLLM; docs/memory.md).
GPU_RUNTIME_BYTES = {"trainer": int(1.39e9), "forward": int(1.0 * GiB), "engine": int(1.0 * GiB)}
GPU_ZERO3_RUNTIME_BYTES = int(0.41e9)
# A loaded tokenizer's resident memory per byte of its files: 12.6 for a 28 MB tokenizer.json
# (151,936 tokens), 17.6 for SmolLM2's 3.5 MB one (measured 2026-11-27: RSS before and after
# AutoTokenizer.from_pretrained). run.py and each engine load one; the trainers do not.
TOKENIZER_BYTES_PER_FILE_BYTE = 13
GPU_ENGINE_GRAPHS_BYTES = int(0.5 * GiB)  # vLLM's CUDA graphs when engine.enforce_eager=false
# One NCCL communicator's buffers on a GPU: NCCL_BUFFSIZE (4 MiB) for each of its protocols' send and
# receive buffers, over up to 32 channels on NVLink (stated from NCCL's defaults; not measured here).
NCCL_COMMUNICATOR_BYTES = int(0.5 * GiB)
# A trainer keeping torch's default caching allocator (scripts/bench/bench_gpu.py, docs/measurements/gpu_runs/) reserved
# above its measured peak 13-31 % of it on an H100 (2026-11-27) and 18-46 % on an H200 (2026-11-28).
# The term is a fraction of the *planned* peak, which over-counts the tensors (gradients planned as
# always resident), so what it must cover is the process's GPU memory less the planned runtime, over
# the planned peak, less 1: with the plan as it is now at most 30.5 % (H100, 0.5B ZeRO-3) and 26.4 %
# (H200, 1.5B ZeRO-3 with gradient checkpointing); tests/memory/test_memory_plan.py recomputes it from the
# logs. (It was 17 %: the H100's against the plan of that day.) With expandable segments (the
# trainers' default on GPUs) a process held at most 1.4 % more than planned: the margin
# (launcher.memory_margin).
DEFAULT_ALLOCATOR_RESERVE = 0.31


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    phase: str = ALWAYS
    on_host: bool = False  # held in host memory although the process runs on a GPU (offload, sleep)
    # File-backed pages (shared libraries, the memory-mapped checkpoint): in every process's RSS, but
    # page cache the processes share -- the host holds them once.
    reclaimable: bool = False


@dataclass(frozen=True)
class Workload:
    """The run's quantities that size activations and caches (derived from the config)."""

    dtype: str
    max_seq_len: int  # prompt + response tokens, the longest sequence
    micro_batch_size: int  # sequences per forward/backward on one rank
    tokens_per_micro_batch: int  # the largest micro-batch in tokens
    padded: bool  # micro-batches are padded rectangles (else packed rows)
    zero_stage: int
    optimizer: str
    offload_optimizer: bool
    gradient_checkpointing: bool
    on_gpu: bool
    # Packed transfers: the token budget micro-batches are packed up to, transfer.token_budget or
    # the one it derives (0: padded, counted in sequences)
    token_bound: int = 0
    sequences_per_rank_step: int = 0  # sequences one policy rank packs for one optimizer step
    # engines
    engine_tp: int = PlacementConfig.engine_tp
    kv_cache_gb: Optional[float] = None
    gpu_memory_utilization: float = 0.9
    gpu_memory_bytes: int = 0
    sleep_level: int = 0
    enforce_eager: bool = True
    sequences_per_engine: int = 1  # sequences one engine generates per step
    # CPU engines with engine.kv_cache_gb null: the sequences one holds at once (rollouts generated
    # together, an evaluation) and its KV block size, which size its cache (engines.launch).
    kv_sequences: int = 1
    kv_block_size: int = 32
    sync_bucket_bytes: int = 0  # sync.bucket_mb of the bucketed syncs; 0 = tensor by tensor
    # From the sync strategy: (policy rank, bytes of its send buffers: on the GPU on GPU layouts, in
    # host memory on CPU ones), and on GPU layouts the policy ranks that share an NCCL communicator
    # with the engines (whose every worker joins it).
    sync_send_buffers: tuple[tuple[int, int], ...] = ()
    sync_nccl_senders: frozenset = frozenset()
    # The trainers keep torch's default CUDA allocator (a sync that hands engines its CUDA memory):
    # its reserve above the peak is planned (expandable segments otherwise).
    trainers_default_allocator: bool = False
    entropy: bool = False  # the actor computes the entropy bonus (algo.entropy_coef > 0)
    # The pipeline generates while the trainers train (one_step_off, async): a colocated engine is
    # awake then, so its weights and KV cache count in the training phase too.
    engines_overlap_training: bool = False
    engines_sleep: bool = True  # the pipeline puts idle engines to sleep (async never does)
    # model.lora: the policy trains adapters of this rank on these targets (0: every weight trains);
    # engines serving the adapter (sync adapter or auto) hold its LoRA slots.
    reference_memory: str = TrainerConfig.reference_memory  # full, sharded (ZeRO-3) or offloaded
    lora_rank: int = LoraConfig.rank
    lora_targets: Any = LoraConfig.target_modules
    engines_serve_adapter: bool = False

    @property
    def w(self) -> int:
        return BYTES_PER_ELEMENT[self.dtype]


@dataclass
class ProcessMemory:
    """The terms of one process of one role."""

    role: str
    rank: int
    terms: list[Term] = field(default_factory=list)
    note: str = ""

    def total(self, phases: tuple[str, ...] = (ALWAYS, *PHASES), on_host: bool = False, resident: bool = True) -> int:
        """Bytes of the terms in `phases`; `resident=False` leaves out reclaimable page cache."""
        return sum(
            t.bytes
            for t in self.terms
            if t.phase in phases and t.on_host == on_host and (resident or not t.reclaimable)
        )

    def peak(self, on_host: bool = False, resident: bool = True) -> int:
        """The process's high-water mark: what it always holds plus its largest phase (a step's
        phases follow one another in one process: the old log-probs' logits are freed before the
        update's activations exist)."""
        return max(self.total((ALWAYS, phase), on_host, resident) for phase in PHASES)


#: The terms of a process's own runtime (what a role hosted in another's process does not add).
RUNTIME_TERM_NAMES = ("runtime", "shared libraries", "nccl buffers")  # (its host's world is the one it uses)


def tokenizer_terms(shape: ModelShape, on_gpu: bool) -> list[Term]:
    """The tokenizer a driver or engine process loads (in host memory: planned on CPU layouts)."""
    nbytes = shape.tokenizer_file_bytes * TOKENIZER_BYTES_PER_FILE_BYTE
    return [Term("tokenizer", nbytes)] if nbytes and not on_gpu else []


def runtime_terms(kind: str, on_gpu: bool, gpu_extra: int = 0) -> list[Term]:
    if on_gpu:
        return [Term("runtime", GPU_RUNTIME_BYTES[kind] + gpu_extra)]
    anonymous, libraries = CPU_RUNTIME_BYTES[kind]
    return [Term("runtime", anonymous), Term("shared libraries", libraries, reclaimable=True)]


def layer_activation_bytes(shape: ModelShape, wl: Workload) -> int:
    """What one layer keeps for its backward over one micro-batch (and, transiently, the gradients
    of those tensors while the backward passes through it)."""
    tokens, w = wl.tokens_per_micro_batch, wl.w
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Per token and layer: the two RMSNorm inputs in fp32, their outputs, q/k/v and the rotated q/k,
    # the attention output, the residual, and the SwiGLU MLP's gate, up, act(gate) and product.
    per_token_layer = 2 * shape.hidden * 4 + w * (4 * shape.hidden + 3 * q_out + 3 * kv_out + 4 * shape.intermediate)
    if wl.padded and not wl.on_gpu:
        # sdpa with a padding mask takes the math kernel on CPU: softmax(QK^T) is kept per layer.
        scores = wl.micro_batch_size * shape.heads * wl.max_seq_len**2 * 4
    else:
        scores = 0  # flash / memory-efficient kernels keep no s^2 tensor
    return tokens * per_token_layer + scores


def activation_bytes(shape: ModelShape, wl: Workload) -> int:
    """Saved-for-backward activations of one micro-batch through all layers."""
    tokens, w = wl.tokens_per_micro_batch, wl.w
    one_layer = layer_activation_bytes(shape, wl)
    if wl.gradient_checkpointing:
        return shape.layers * tokens * shape.hidden * w + one_layer
    return shape.layers * one_layer


# DeepSpeed's default reduce_bucket_size (elements): ZeRO-2/3 reduce gradients through a bucket this large.
REDUCE_BUCKET_ELEMENTS = 500_000_000
# DeepSpeed's default stage3_max_live_parameters: ZeRO-3 keeps up to this many gathered parameters alive.
ZERO3_LIVE_PARAMETERS = 1_000_000_000


def checkpoint_load_term(params: int, shape: ModelShape, wl: Workload) -> list[Term]:
    """On the CPU the checkpoint's safetensors pages, memory-mapped and read once while loading, stay
    in the process's resident high-water mark (on a GPU they are host memory: not planned here)."""
    return [] if wl.on_gpu else [Term("checkpoint load", params * shape.checkpoint_bytes_per_param, reclaimable=True)]


def trainer_terms(
    role: str, params: int, shape: ModelShape, wl: Workload, dp: int, rank: int = 0, stage: int | None = None
) -> list[Term]:
    """Actor or critic rank under DeepSpeed ZeRO, as DeepSpeed allocates it, at the stage the role
    runs (`zero_stage_to_run`: a role of one rank runs ZeRO-1/2 as stage 0). `stage`: the stage
    DeepSpeed is given where a caller builds it by hand at another (scripts/bench/bench_gpu.py runs
    one rank at ZeRO-1 and ZeRO-2 as measured on the GPUs).

    From ZeRO-1 DeepSpeed keeps an fp32 partition of the weights (the optimizer's master copy) even
    when the model is float32, and fp32 gradient partitions; ZeRO-2/3 reduce gradients through a
    bucket of up to `REDUCE_BUCKET_ELEMENTS` elements.
    """
    w, z = wl.w, zero_stage_to_run(wl.zero_stage, dp, wl.offload_optimizer) if stage is None else stage
    shard = lambda nbytes, from_stage: nbytes // dp if z >= from_stage else nbytes  # noqa: E731
    offload = wl.offload_optimizer and wl.on_gpu
    terms = [Term("weights", shard(params * w, 3))]
    trained = params  # what gets gradients, master weights and optimizer states
    if role == "actor" and wl.lora_rank:
        # model.lora: the base is frozen -- gradients, master weights and optimizer states are the
        # adapters' only. (Activations stay counted as full fine-tuning's, an upper bound: a frozen
        # layer's input is kept only where an adapter needs it.)
        trained = shape.lora_params(wl.lora_rank, wl.lora_targets)
        terms.append(Term("adapters", shard(trained * w, 3)))
    if z == 0:
        terms.append(Term("gradients", trained * w))
        if w < 4:  # mixed precision without ZeRO: DeepSpeed's bf16 optimizer keeps fp32 gradients and master weights
            terms += [
                Term("fp32 gradients", trained * 4, on_host=offload),
                Term("master weights", trained * 4, on_host=offload),
            ]
    else:
        model_grads = trained * w if z == 1 else min(trained, REDUCE_BUCKET_ELEMENTS) * w
        if z == 2 and w < 4:
            # ZeRO-2 reduces each gradient into this rank's partition in the model's dtype before the
            # fp32 copy (DeepSpeed's estimator counts it: its "2_grads_16bit"); a float32 model's
            # partition is that fp32 copy.
            terms.append(Term("gradient partition", trained * w // dp))
        terms += [
            Term("gradients", model_grads),
            Term("fp32 gradients", trained * 4 // dp, on_host=offload),
            Term("master weights", trained * 4 // dp, on_host=offload),
        ]
    if wl.optimizer == "adamw":
        terms.append(Term("optimizer", shard(trained * 8, 1), on_host=offload))
    if z == 3:  # parameters gathered for the forward/backward stay alive up to DeepSpeed's limit
        terms.append(Term("gathered weights", min(params, ZERO3_LIVE_PARAMETERS) * w, TRAIN))
    terms.append(Term("activations", activation_bytes(shape, wl), TRAIN))
    # The backward holds the gradients of one layer's saved tensors while it passes through it.
    terms.append(Term("backward workspace", layer_activation_bytes(shape, wl), TRAIN))
    if role == "actor":
        logit_elements = wl.tokens_per_micro_batch * shape.vocab
        terms.append(Term("logits", logit_elements * (2 * w + VOCAB_REDUCTION_SAVED_BYTES_PER_ELEMENT), TRAIN))
        if wl.entropy:
            terms.append(Term("entropy", logit_elements * (w + VOCAB_REDUCTION_SAVED_BYTES_PER_ELEMENT), TRAIN))
        terms += forward_pass_terms(shape, wl, "old log-probs")
    terms += checkpoint_load_term(params, shape, wl)
    # A CPU layout's sending rank packs its buckets in host memory while it sends (two buckets, at
    # most the weights; on a GPU: `gpu_trainer_terms`).
    send = dict(wl.sync_send_buffers).get(rank, 0) if role == "actor" and not wl.on_gpu else 0
    if send:
        terms.append(Term("sync send buffers", min(send, 2 * synced_bytes(shape, wl)), GENERATE))
    if wl.on_gpu:
        terms += gpu_trainer_terms(role, rank, terms, wl, dp)
    terms += runtime_terms("trainer", wl.on_gpu, GPU_ZERO3_RUNTIME_BYTES if z == 3 else 0)
    return terms


def forward_pass_terms(shape: ModelShape, wl: Workload, logits_name: str = "logits") -> list[Term]:
    """One forward without gradients over a micro-batch (old or reference log-probs): the logits in
    the model's dtype and one layer's transient tensors, in the experience phase."""
    return [
        Term(logits_name, wl.tokens_per_micro_batch * shape.vocab * wl.w, EXPERIENCE),
        Term(
            "forward activations", wl.tokens_per_micro_batch * (2 * shape.hidden + shape.intermediate) * 4, EXPERIENCE
        ),
    ]


def gpu_trainer_terms(role: str, rank: int, terms: list[Term], wl: Workload, dp: int) -> list[Term]:
    """What a trainer rank holds on a GPU besides its tensors' model states and activations: the
    weight sync's send buffers (a sending policy rank), NCCL's buffers, the default allocator's
    reserve (planned on the peak phase's tensors)."""
    extra = []
    policy = role == "actor"
    send_buffers = dict(wl.sync_send_buffers).get(rank, 0) if policy else 0
    if send_buffers:
        extra.append(Term("sync send buffers", send_buffers, GENERATE))
    communicators = int(dp > 1) + int(policy and rank in wl.sync_nccl_senders)
    if communicators:
        extra.append(Term("nccl buffers", communicators * NCCL_COMMUNICATOR_BYTES))
    if wl.trainers_default_allocator:
        extra += allocator_reserve(terms)
    return extra


def allocator_reserve(terms: list[Term]) -> list[Term]:
    """torch's default allocator's reserve above what a process holds, in each phase of a step
    (`DEFAULT_ALLOCATOR_RESERVE` of that phase's tensors): a trainer sharing its GPU gives its cache
    back as each of its phases ends (rlhf_orch/trainer/phase_memory.py), so the reserve above its
    training peak is not held while a colocated engine generates. On a GPU of its own the same:
    its peak phase's reserve."""
    held = ProcessMemory("", 0, terms)
    return [
        Term("allocator reserve", int(DEFAULT_ALLOCATOR_RESERVE * held.total((ALWAYS, phase))), phase)
        for phase in PHASES
    ]


def forward_only_terms(role: str, params: int, shape: ModelShape, wl: Workload, dp: int = 1) -> list[Term]:
    """Reference or reward model: weights, and one forward's transient tensors. A reference held
    by ZeRO-3 (trainer.reference_memory) keeps 1/dp of its weights -- in host memory when offloaded
    -- and gathers up to DeepSpeed's live-parameter limit for its forward."""
    sharded = role == "reference" and wl.reference_memory != "full"
    if sharded:
        terms = [
            Term("weights", params * wl.w // dp, on_host=wl.reference_memory == "offloaded" and wl.on_gpu),
            Term("gathered weights", min(params, ZERO3_LIVE_PARAMETERS) * wl.w, EXPERIENCE),
        ]
    else:
        terms = [Term("weights", params * wl.w)]
    terms += checkpoint_load_term(params, shape, wl)
    forward = forward_pass_terms(shape, wl)
    terms += (
        forward if role == "reference" else [t for t in forward if t.name != "logits"]
    )  # a reward model scores, no [T, V]
    if wl.on_gpu:
        if sharded and dp > 1:
            terms.append(Term("nccl buffers", NCCL_COMMUNICATOR_BYTES))  # its ranks' world
        if wl.trainers_default_allocator:  # (forward-only processes get the trainers' allocator setting)
            terms += allocator_reserve(terms)
    if (
        sharded and wl.on_gpu
    ):  # a DeepSpeed engine's ZeRO-3 buffers (kept where the reference lives in the policy's process)
        terms.append(Term("zero-3 runtime", GPU_ZERO3_RUNTIME_BYTES))
    terms += runtime_terms("forward", wl.on_gpu)  # no optimizer
    return terms


#: Terms each DeepSpeed engine or each loaded model of a process has its own of: a process holding
#: the teacher beside the KL reference holds two (the rest of the two models' terms are transient
#: and run one after the other: the larger counts).
PER_MODEL_TERMS = ("zero-3 runtime", "allocator reserve")


def with_teacher_terms(reference: list[Term] | None, teacher: list[Term]) -> list[Term]:
    """A reference rank holding the teacher too (teacher=<model option>): both models' weights and
    checkpoint loads (the teacher's as "teacher weights" / "teacher checkpoint load"), each model's
    `PER_MODEL_TERMS`, and of every other term the larger of the two -- the models run their
    forwards one after the other in one process. `reference` None: the rank holds the teacher
    alone (no KL term, or a LoRA policy's own base is the reference)."""
    own = {"weights": "teacher weights", "checkpoint load": "teacher checkpoint load"}
    teacher = [Term(own.get(t.name, t.name), t.bytes, t.phase, t.on_host, t.reclaimable) for t in teacher]
    if reference is None:
        return teacher
    out = list(reference)
    for t in teacher:
        same = [k for k, r in enumerate(out) if (r.name, r.phase, r.on_host) == (t.name, t.phase, t.on_host)]
        if not same or t.name in PER_MODEL_TERMS:
            out.append(t)
        elif t.bytes > out[same[0]].bytes:
            out[same[0]] = t
    return out


# vLLM's sampler warm-up per logit of its max_num_seqs x vocabulary rows: the float32 logits and
# probabilities, and the top-k/top-p sort's values and int64 indices.
SAMPLER_BYTES_PER_LOGIT = 24


def vllm_profile_sizes(wl: Workload) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM profiles with: its defaults for the offline
    engine, which this project does not override (vllm/engine/arg_utils.py: CPU 4096 and 256 per
    tensor-parallel worker -- a CPU engine's terms are per worker; GPUs of 70 GiB or more 16384 and
    1024, A100s and smaller GPUs 8192 and 256: an 80 GB A100 is planned as the larger)."""
    if not wl.on_gpu:
        return 4096, 256
    if wl.gpu_memory_bytes >= 70 * GiB:
        return 16384, 1024
    return 8192, 256


def synced_bytes(shape: ModelShape, wl: Workload) -> int:
    """What one weight sync carries: every weight, or under an adapter update the adapter only."""
    sent = shape.lora_params(wl.lora_rank, wl.lora_targets) if wl.engines_serve_adapter else shape.policy_params
    return sent * wl.w


def engine_terms(shape: ModelShape, wl: Workload) -> tuple[list[Term], str]:
    """One engine process (one GPU of it when tensor-parallel), and a note when its KV cache is short."""
    tp = wl.engine_tp
    weights = shape.policy_params * wl.w // tp
    # vLLM profiles a forward over its whole batched-token budget (the hidden states and the MLP's
    # intermediate) and warms its sampler up over max_num_seqs rows of logits, whatever this run
    # asks of it (`vllm_profile_sizes`).
    batched_tokens, max_seqs = vllm_profile_sizes(wl)
    # (one after the other: the larger counts)
    workspace = max(
        batched_tokens * (2 * shape.hidden + shape.intermediate) * 4 // tp,
        max_seqs * shape.vocab * SAMPLER_BYTES_PER_LOGIT,
    )
    graphs = GPU_ENGINE_GRAPHS_BYTES if wl.on_gpu and not wl.enforce_eager else 0
    # model.lora served as an adapter: vLLM's LoRA buffers (one adapter slot at its max rank, A and B
    # of every adapted projection; counted as the adapter's own size at the rank vLLM rounds up to).
    served_rank = LoraSettings(rank=wl.lora_rank).engine_max_rank() if wl.engines_serve_adapter else 0
    lora_slots = shape.lora_params(served_rank, wl.lora_targets) * wl.w // tp
    communicators = int(tp > 1) + int(bool(wl.sync_nccl_senders))  # vLLM's tensor-parallel group, the weight sync's
    nccl = communicators * NCCL_COMMUNICATOR_BYTES if wl.on_gpu else 0
    wanted_kv = wl.sequences_per_engine * wl.max_seq_len * shape.kv_bytes_per_token(wl.w) // tp
    one_sequence_kv = wl.max_seq_len * shape.kv_bytes_per_token(wl.w) // tp
    if wl.kv_cache_gb is not None:
        kv = int(wl.kv_cache_gb * GiB)
    elif wl.on_gpu:
        # vLLM takes gpu_memory_utilization of the GPU and gives the KV cache what the rest leaves.
        # (NCCL's buffers too: vLLM's profile counts memory outside torch against the budget)
        kv = (
            int(wl.gpu_memory_utilization * wl.gpu_memory_bytes)
            - weights
            - workspace
            - graphs
            - lora_slots
            - nccl
            - GPU_RUNTIME_BYTES["engine"]
        )
    else:  # what the engine is given (rlhf_orch.orchestration.session.engine_kv_cache_bytes)
        kv = cpu_kv_cache_bytes(wl.kv_sequences, wl.max_seq_len, shape.kv_bytes_per_token(wl.w), tp, wl.kv_block_size)
    note = ""
    if kv < one_sequence_kv:
        left = "nothing" if kv <= 0 else f"{kv / GiB:.2f} GiB"
        note = (
            f"its memory budget leaves {left} for the KV cache after weights and workspace, less than one "
            f"{wl.max_seq_len}-token sequence ({one_sequence_kv / GiB:.3f} GiB): vLLM refuses to start"
        )
    elif kv < wanted_kv:
        note = (
            f"KV cache {kv / GiB:.2f} GiB < {wanted_kv / GiB:.2f} GiB for all {wl.sequences_per_engine} sequences "
            "at once: vLLM runs them in waves (slower, fits)"
        )
    # A sleeping engine (colocated GPUs) gives weights and KV cache back while the trainers train;
    # level 1 parks the weights in host memory.
    asleep = wl.on_gpu and wl.sleep_level > 0 and wl.engines_sleep
    phase = GENERATE if asleep and not wl.engines_overlap_training else ALWAYS
    terms = [
        Term("weights", weights, phase),
        Term("kv cache", max(kv, 0), phase),
        Term("workspace", workspace, phase),
    ]
    if graphs:
        terms.append(Term("cuda graphs", graphs, phase))
    if lora_slots:
        terms.append(Term("lora slots", lora_slots, phase))
    if not wl.on_gpu:
        # vLLM's CPU backend keeps a re-packed copy of every linear weight for its GEMM kernels, and
        # holds the weight-sync receive buffers (two buckets in flight) while a sync runs: freed after
        # it (`WorkerReceiver.release_buffers`), in its generate phase, still in its high-water mark.
        terms.append(Term("cpu weight packing", shape.linear_params * wl.w // tp))
        # A bucket never exceeds the weights; tensor-by-tensor syncs receive the largest tensor (the embedding).
        bucket = min(wl.sync_bucket_bytes or shape.vocab * shape.hidden * wl.w, synced_bytes(shape, wl))
        terms.append(Term("sync buffers", 2 * bucket, GENERATE))
        terms += checkpoint_load_term(shape.policy_params // tp, shape, wl)
    if asleep and wl.sleep_level == 1:
        # Parked in host memory while asleep (one_step_off sleeps once its generation is done, which
        # may be mid-training).
        terms.append(Term("weights (asleep)", weights, TRAIN, on_host=True))  # host: not in GPU sums
    if nccl:
        terms.append(Term("nccl buffers", nccl))
    terms += tokenizer_terms(shape, wl.on_gpu)
    terms += runtime_terms("engine", wl.on_gpu)
    return terms, note
