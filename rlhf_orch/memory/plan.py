"""The memory plan of a run: every role process's terms (`rlhf_orch.memory.terms`), summed per device
(each GPU on GPU layouts, the host on CPU) and set against what the device has, before Ray starts.

On a GPU the peak is the larger of the two phases of a step: generating (engines awake, trainers
holding their states) and training (activations; a sleeping colocated engine has given its weights
and KV cache back). Processes on the CPU keep their high-water marks, so the host holds the sum of
every process's peak at once, plus the driver and Ray's own processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from omegaconf import OmegaConf

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.engines.launch import (
    SLEEP_WHERE_AVAILABLE,
    kv_block_size,
    kv_sequences_per_engine,
    memory_utilization,
    sleep_level,
)
from rlhf_orch.memory.shapes import ModelShape
from rlhf_orch.memory.terms import (
    ALWAYS,
    PHASES,
    RUNTIME_TERM_NAMES,
    GiB,
    ProcessMemory,
    Term,
    Workload,
    engine_terms,
    forward_only_terms,
    runtime_terms,
    tokenizer_terms,
    trainer_terms,
    with_teacher_terms,
)
from rlhf_orch.topology.plan import PlacementPlan

GB = 10**9
#: placement.gpu_memory_gb is a GPU's size as it is sold and named ("80GB" A100 / H100), in GiB less
#: the ~1 % the driver keeps: an H100 80GB reports 85.0175e9 bytes (torch's total_memory,
#: docs/measurements/gpu_runs/2026-11-27-h100), an A100 40GB 42.505e9; 0.9895 GiB per "GB" gives 84.996e9 and
#: 42.499e9, at most what they report (it was read as 1e9: 6 % short).
GPU_SIZE_UNIT = int(0.9895 * GiB)
#: What a GPU is assumed to hold when neither placement.gpu_memory_gb nor a GPU here says.
ASSUMED_GPU_GB = 80.0
#: Ray kills a worker once the host's memory use passes this fraction (RAY_memory_usage_threshold).
RAY_MEMORY_THRESHOLD = 0.95


@dataclass(frozen=True)
class Device:
    name: str  # "gpu n0/b3" or "host"
    capacity: int  # bytes the processes on it may use
    capacity_source: str  # where the capacity was read
    margin: int = 0  # bytes kept free for what the plan does not model (launcher.memory_margin x capacity)


@dataclass
class DeviceLoad:
    device: Device
    processes: list[ProcessMemory] = field(default_factory=list)
    sums_phases: bool = True  # GPU: the worse of the two phases; host: every term at once

    @property
    def need(self) -> int:
        if not self.sums_phases:
            # The host: every process's anonymous memory at its peak, plus the page cache the processes share
            # (the shared libraries, the checkpoint file) once -- the largest of each kind.
            shared: dict[str, int] = {}
            for p in self.processes:
                for t in p.terms:
                    if t.reclaimable:
                        shared[t.name] = max(shared.get(t.name, 0), t.bytes)
            return sum(p.peak(resident=False) + p.peak(on_host=True, resident=False) for p in self.processes) + sum(
                shared.values()
            )
        return max(sum(p.total((ALWAYS, phase)) for p in self.processes) for phase in PHASES)

    @property
    def headroom(self) -> int:
        """What is left after the need and the margin (negative: does not fit)."""
        return self.device.capacity - self.device.margin - self.need

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def peak_phase(self) -> str:
        """The phase of a step in which this device's need peaks (`always` on the host, which sums every process's peak)."""
        if not self.sums_phases:
            return ALWAYS
        return max(PHASES, key=lambda phase: sum(p.total((ALWAYS, phase)) for p in self.processes))

    def largest_terms(self, n: int = 3) -> list[tuple[str, int]]:
        terms = [(f"{p.role}{p.rank} {t.name}", t.bytes) for p in self.processes for t in p.terms if not t.on_host]
        return sorted(terms, key=lambda item: -item[1])[:n]


@dataclass
class MemoryPlan:
    model: str  # where the shape was read
    shape: ModelShape
    workload: Workload
    processes: list[ProcessMemory]
    loads: list[DeviceLoad]
    batch: dict[str, Any]

    @property
    def fits(self) -> bool:
        return all(load.fits for load in self.loads) and not self.engine_problems

    @property
    def engine_problems(self) -> list[str]:
        return sorted({p.note for p in self.processes if p.role == "engine" and "refuses" in p.note})

    def worst(self) -> DeviceLoad:
        return min(self.loads, key=lambda load: load.headroom)

    def worst_gpu(self) -> DeviceLoad:
        """The GPU with the least headroom (the worst load on plans without GPUs): what the engine's
        share and tensor parallelism are sized against, not a node's host memory."""
        gpus = [load for load in self.loads if load.device.name.startswith("gpu")]
        return min(gpus, key=lambda load: load.headroom) if gpus else self.worst()


# --------------------------------------------------------------------------- inputs from the config
def gpu_memory(typed: RootConfig) -> tuple[int, str]:
    """(bytes of one GPU, where that figure comes from)."""
    configured = getattr(typed.placement, "gpu_memory_gb", None)
    if configured is not None:
        return int(configured * GPU_SIZE_UNIT), "placement.gpu_memory_gb"
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory), f"{torch.cuda.get_device_name(0)}"
    except Exception:  # no usable CUDA: fall back to the assumption, said in the table
        pass
    return int(ASSUMED_GPU_GB * GPU_SIZE_UNIT), f"assumed an {ASSUMED_GPU_GB:g}GB GPU (set placement.gpu_memory_gb)"


def node_host_loads(
    typed: RootConfig, plan: PlacementPlan, processes: dict[tuple[str, int], ProcessMemory], engine_tp: int
) -> list[DeviceLoad]:
    """GPU layouts: each node's host memory against what its processes keep there (offloaded
    optimizer states and master weights, a sleeping engine's parked weights: each of a
    tensor-parallel engine's `engine_tp` workers parks its own shard), counted at once. A node's RAM
    is `placement.host_memory_gb`, else this machine's when the run starts here on CUDA GPUs (this
    machine is its node); otherwise (a dry run, a cluster) it is not known and not planned. Nothing
    to plan without such terms. Not counted: each process's own host memory (the model as loaded,
    the runtime), the driver, Ray's object store (docs/memory.md)."""
    capacity = node_host_memory(typed)
    loads = []
    for node_index in range(len(plan.nodes)):
        on_node = {(s.role, s.rank) for s in plan.slots if s.node == node_index}
        views = [
            ProcessMemory(
                p.role,
                p.rank,
                [Term(t.name, t.bytes * (engine_tp if p.role == "engine" else 1)) for t in p.terms if t.on_host],
                p.note,
            )
            for key, p in processes.items()
            if key in on_node and any(t.on_host for t in p.terms)
        ]
        if views and capacity is not None:
            loads.append(
                DeviceLoad(
                    Device(f"host n{node_index}", *capacity, margin=margin_bytes(typed, capacity[0])),
                    views,
                    sums_phases=False,
                )
            )
    return loads


def node_host_memory(typed: RootConfig) -> Optional[tuple[int, str]]:
    """(bytes a GPU node's processes may keep in host memory, where from), or None: unknown here."""
    configured = getattr(typed.placement, "host_memory_gb", None)
    threshold = ray_memory_threshold()
    if configured is not None:
        return int(configured * GiB * threshold), f"placement.host_memory_gb x {threshold:g} (Ray's kill threshold)"
    if typed.launcher.dry_run or typed.launcher.address is not None:
        return None
    from rlhf_orch.cuda_probe import cuda_available

    if not cuda_available():
        return None
    capacity, source = host_memory()
    return capacity, f"{source}, this machine (set placement.host_memory_gb)"


def margin_bytes(typed: RootConfig, capacity: int) -> int:
    """launcher.memory_margin of a device's capacity, kept free (`DEFAULT_MEMORY_MARGIN` says why)."""
    return int(typed.launcher.memory_margin * capacity)


def ray_memory_threshold() -> float:
    return float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD))


def host_memory() -> tuple[int, str]:
    """(bytes this host's processes may use before Ray's memory monitor kills one, where from)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    threshold = ray_memory_threshold()
    return int(total * threshold), f"{total / GiB:.1f} GiB RAM x {threshold:g} (Ray's kill threshold)"


def workload(typed: RootConfig, plan: PlacementPlan, on_gpu: bool, gpu_bytes: int) -> Workload:
    a, d, t, e = typed.algo, typed.data, typed.trainer, typed.engine
    max_seq = d.prompt_max_len + d.response_max_len
    tokens, padded = typed.transfer.largest_micro_batch(a.micro_batch_size, max_seq)
    engines = max(plan.num_ranks("engine"), 1)
    level = sleep_level(e.sleep_level, plan)
    if level == SLEEP_WHERE_AVAILABLE:
        level = 1 if on_gpu else 0  # vLLM's sleep mode needs CUDA (rlhf_orch.engines.vllm_engine)
    return Workload(
        dtype=typed.model.dtype,
        max_seq_len=max_seq,
        micro_batch_size=a.micro_batch_size,
        tokens_per_micro_batch=tokens,
        padded=padded,
        token_bound=0 if padded else tokens,
        # (each optimizer step's sequences are packed on their own: `plan_token_budget_micro_batches`)
        sequences_per_rank_step=a.train_batch_size // max(plan.num_ranks("actor"), 1),
        zero_stage=t.zero_stage,
        optimizer=t.optimizer,
        offload_optimizer=t.offload_optimizer,
        gradient_checkpointing=t.gradient_checkpointing,
        on_gpu=on_gpu,
        engine_tp=plan.engine_tp,
        kv_cache_gb=e.kv_cache_gb,
        gpu_memory_utilization=memory_utilization(e.gpu_memory_utilization, plan),
        gpu_memory_bytes=gpu_bytes,
        sleep_level=level,
        enforce_eager=e.enforce_eager,
        sequences_per_engine=-(-a.rollout_batch_size * a.samples_per_prompt // engines),
        kv_sequences=kv_sequences_per_engine(
            a.rollout_batch_size * a.samples_per_prompt, getattr(typed.pipeline, "max_staleness", 0) + 1, engines
        ),
        kv_block_size=kv_block_size(e.block_size, is_cpu=True),  # read by the CPU engine's KV term only
        sync_bucket_bytes=int(getattr(typed.sync, "bucket_mb", 0) * 2**20),
        **_sync_buffers(typed, plan, on_gpu),
        entropy=a.entropy_coef > 0,
        engines_overlap_training=_pipeline_says(typed, "engines_awake_in_training", False),
        engines_sleep=_pipeline_says(typed, "sleeps_engines", True),
        reference_memory=t.reference_memory,
        lora_rank=typed.model.lora.rank,
        lora_targets=typed.model.lora.target_modules,
        # (auto: planned as adapter, what vLLM does for the architectures it serves with LoRA)
        engines_serve_adapter=typed.model.lora.rank > 0 and typed.model.lora.sync != "merged",
    )


def _sync_buffers(typed: RootConfig, plan: PlacementPlan, on_gpu: bool) -> dict[str, Any]:
    """What the chosen weight sync holds, as its strategy object says: each sender's buffers in
    flight (on GPUs, or in host memory on a CPU layout); on GPUs also the ranks in an NCCL group
    with the engines and whether the trainers keep torch's default allocator (CUDA memory handed
    to engines)."""
    from hydra.utils import instantiate

    sync = instantiate(OmegaConf.structured(typed.sync))
    sync.use_plan(plan)
    ranks, engines = max(plan.num_ranks("actor"), 1), max(plan.num_ranks("engine"), 1)
    buffers = {"sync_send_buffers": tuple(sorted(sync.send_buffers(ranks, engines, on_gpu).items()))}
    if not on_gpu:
        return buffers
    return {
        **buffers,
        "sync_nccl_senders": frozenset(sync.nccl_senders(ranks, engines)),
        "trainers_default_allocator": bool(sync.shares_cuda_memory),
    }


def _pipeline_says(typed: RootConfig, attribute: str, default: bool) -> bool:
    """The chosen pipeline class's answer (`RolloutPipeline`'s ClassVars): whether its engines are
    awake while the trainers train, whether it ever puts them to sleep. A user's class without the
    attribute gets the sync pipeline's answer."""
    from hydra.utils import get_class

    return bool(getattr(get_class(typed.pipeline._target_), attribute, default))


def batch_quantities(typed: RootConfig, plan: PlacementPlan, wl: Workload) -> dict[str, Any]:
    """The derived batch sizes people confuse, for one step."""
    a = typed.algo
    samples = a.rollout_batch_size * a.samples_per_prompt
    dp = max(plan.num_ranks("actor"), 1)
    return {
        "prompts per step": a.rollout_batch_size,
        "samples per step": samples,
        "sequences per optimizer step": a.train_batch_size,
        "optimizer steps per rollout": samples // max(a.train_batch_size, 1) * a.ppo_epochs,
        "policy ranks": dp,
        "micro-batches per rank per optimizer step": a.train_batch_size // max(a.micro_batch_size * dp, 1),
        "sequences per micro-batch": a.micro_batch_size,
        "tokens per micro-batch": f"{wl.tokens_per_micro_batch} ({'padded' if wl.padded else 'packed'})",
    }


def _frozen_models_terms(
    typed: RootConfig, shape: ModelShape, teacher: Optional[ModelShape], wl: Workload, dp: int, rank: int, hosted: bool
) -> tuple[list[Term], str]:
    """Reference rank `rank`: the frozen models the algorithm reads (`AlgoConfig.frozen_models`),
    the KL reference in the policy's shape and dtype, the teacher in its own. `hosted`: inside the
    policy rank's process (no runtime of its own; under model.lora the reference is the policy's
    base: no weights or load of its own either)."""
    held = typed.algo.frozen_models
    base = hosted and wl.lora_rank > 0 and "ref" in held  # the reference is the LoRA policy's own base
    reference = None
    if "ref" in held:
        reference = forward_only_terms("reference", shape.policy_params, shape, wl, dp)
        if base:
            reference = [t for t in reference if t.name not in ("weights", "checkpoint load")]
    terms, notes = reference or [], []
    if hosted:
        notes.append(f"inside actor{rank}'s process" + (" (the policy's base: model.lora)" if base else ""))
    if "teacher" in held and teacher is not None:
        teacher_wl = replace(wl, dtype=typed.teacher.dtype)
        terms = with_teacher_terms(
            reference, forward_only_terms("reference", teacher.policy_params, teacher, teacher_wl, dp)
        )
        notes.append("reference + teacher" if reference is not None else "teacher")
    if hosted:
        terms = [t for t in terms if t.name not in RUNTIME_TERM_NAMES]
    return terms, ", ".join(notes)


# --------------------------------------------------------------------------- the plan
def plan_memory(
    typed: RootConfig,
    plan: PlacementPlan,
    shape: ModelShape,
    model_source: str,
    on_gpu: bool,
    gpu: Optional[tuple[int, str]] = None,
    host: Optional[tuple[int, str]] = None,
    teacher: Optional[ModelShape] = None,
) -> MemoryPlan:
    """Every role process's memory, per device against its capacity. `on_gpu`: the processes get
    CUDA devices (False: everything lives in host memory, Ray's GPUs being logical if any).
    `teacher`: the teacher's shape (teacher=<model option>), held by the reference ranks."""
    gpu_bytes, gpu_source = gpu or gpu_memory(typed)
    wl = workload(typed, plan, on_gpu, gpu_bytes)
    # Each role's process: what it holds, by the kind of model it runs.
    role_terms = {
        "actor": lambda dp, rank: (trainer_terms("actor", shape.policy_params, shape, wl, dp, rank), ""),
        "critic": lambda dp, rank: (trainer_terms("critic", shape.critic_params, shape, wl, dp, rank), ""),
        "reference": lambda dp, rank: _frozen_models_terms(
            typed, shape, teacher, wl, dp, rank, plan.reference_in_actor
        ),
        "reward": lambda dp, rank: (forward_only_terms("reward", shape.reward_params, shape, wl), ""),
        "engine": lambda dp, rank: engine_terms(shape, wl),
    }
    processes: dict[tuple[str, int], ProcessMemory] = {}
    for slot in plan.slots:
        proc = ProcessMemory(slot.role, slot.rank)
        proc.terms, proc.note = role_terms[slot.role](max(plan.num_ranks(slot.role), 1), slot.rank)
        processes[(slot.role, slot.rank)] = proc

    loads: list[DeviceLoad] = []
    if on_gpu:
        for node_index, bundles in enumerate(plan.nodes):
            for bundle_index, resources in enumerate(bundles):
                if not resources.get("GPU"):
                    continue
                claims = plan.claims_on(node_index, bundle_index)
                device = Device(
                    f"gpu n{node_index}/b{bundle_index}", gpu_bytes, gpu_source, margin_bytes(typed, gpu_bytes)
                )
                loads.append(DeviceLoad(device, [processes[(c.role, c.rank)] for c in claims]))
        loads += node_host_loads(typed, plan, processes, wl.engine_tp)
    else:
        host_bytes, host_source = host or host_memory()
        driver = ProcessMemory(
            "driver",
            0,
            [*tokenizer_terms(shape, on_gpu=False), *runtime_terms("driver", on_gpu=False)],
            "run.py, Ray's raylet/GCS/workers",
        )
        every = [driver, *processes.values()]
        for proc in every:
            if proc.role == "engine" and wl.engine_tp > 1:
                # A CPU engine's TP workers are processes of their own, each with its shard, its own
                # KV space (kv_cache_memory_bytes is per worker) and its runtime: tp times one GPU's terms.
                proc.terms = [Term(t.name, t.bytes * wl.engine_tp, t.phase, t.on_host) for t in proc.terms]
        loads.append(
            DeviceLoad(
                Device("host", host_bytes, host_source, margin_bytes(typed, host_bytes)), every, sums_phases=False
            )
        )
    ordered = [processes[(s.role, s.rank)] for role in plan.roles for s in plan.slots_for(role)]
    return MemoryPlan(model_source, shape, wl, ordered, loads, batch_quantities(typed, plan, wl))
