"""How an engine is started in its planned bundles: pure decisions, tested without GPUs.

An engine slot owns `engine_tp` bundles of one planned node (`PlacementPlan`). With one worker the
engine actor itself claims the slot's GPU share on its bundle and vLLM runs in it (`uni`). With
`engine_tp > 1` on GPUs the actor claims no GPU: vLLM's Ray executor starts one worker per
tensor-parallel rank inside the actor's placement group, on the bundles named by
`VLLM_RAY_BUNDLE_INDICES`, each claiming `VLLM_RAY_PER_WORKER_GPUS` (the slot's share) -- so
every TP worker lands on its planned GPU. vLLM's CPU backend has no Ray executor: there TP
workers are processes of the engine (`mp`), one core group each (`VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf_orch.topology.plan import PlacementPlan, RoleSlot

#: vLLM's own default `gpu_memory_utilization`, used when an engine has its GPUs to itself.
WHOLE_GPU_UTILIZATION = 0.9


@dataclass(frozen=True)
class EngineLaunch:
    """What the driver gives one engine actor: its own GPU claim and the environment for vLLM."""

    actor_num_gpus: float
    env: dict[str, str]
    executor: Optional[str]  # vLLM's distributed_executor_backend (None at TP 1: vLLM's `uni`)


def engine_launch(slot: RoleSlot, gpu_layout: bool) -> EngineLaunch:
    tp = len(slot.bundles)
    if tp == 1:
        return EngineLaunch(slot.num_gpus, {}, None)
    if not gpu_layout:
        # vllm-cpu has no Ray executor (and would pick it inside a placement group): worker processes.
        return EngineLaunch(0.0, {}, "mp")
    env = {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in slot.bundles),
        "VLLM_RAY_PER_WORKER_GPUS": repr(float(slot.num_gpus)),
    }
    return EngineLaunch(0.0, env, "ray")


def memory_utilization(configured: Optional[float], plan: PlacementPlan) -> float:
    """`engine.gpu_memory_utilization`, or (null) the engine's planned share of each of its GPUs."""
    if configured is not None:
        return float(configured)
    engines = plan.slots_for("engine")
    share = engines[0].num_gpus if engines and plan.total_gpus > 0 else 1.0
    return min(share, WHOLE_GPU_UTILIZATION)


# An unset engine.sleep_level on a colocated GPU layout: level 1 where vLLM's platform offers sleep
# mode, else 0 -- decided in the engine, which knows its platform (Ray logical GPUs on CPU do not).
SLEEP_WHERE_AVAILABLE = -1
#: engine.sleep_level 0: the engine never sleeps (an engine spec's default: CPU, split layouts).
NEVER_SLEEP = 0


#: A CPU engine's KV cache when engine.kv_cache_gb is null: every sequence of the training rollouts it
#: generates at once at full length (block-rounded), with this headroom, and at least the floor.
#: vLLM's CPU cache is allocated and written at start, so it is resident memory: the fixed 1 GiB it
#: had before was 1 GB of the tiny default run's 3.7 GB for a few MB of keys and values, and sized
#: for SmolLM2's held-out evaluation (64 prompts x 4) it was 3.1 GiB where its rollouts need 0.4
#: (docs/benchmarks.md). A held-out evaluation of more sequences runs in waves.
CPU_KV_HEADROOM = 1.25
CPU_KV_CACHE_MIN_BYTES = 64 * 2**20
#: A CPU engine given no size (an EngineSpec built by hand, a model of unknown shape): vLLM's own
#: CPU default would be half the machine's memory.
CPU_KV_CACHE_UNSIZED_BYTES = 2**30


#: vLLM's max_num_seqs on CPU: an engine never runs more sequences at once.
CPU_MAX_SEQUENCES = 256


def kv_sequences_per_engine(rollout_sequences: int, rollouts_at_once: int, engines: int) -> int:
    """Sequences one engine's KV cache holds at once: its share of the training rollouts the pipeline
    generates together, up to vLLM's max_num_seqs. Anything larger -- a held-out evaluation of
    eval.num_prompts x eval.samples_per_prompt -- runs in waves: vLLM's scheduler admits the requests
    whose blocks are free and queues the rest. SmolLM2's evaluation (64 prompts x 4, experiment=
    smollm2_arith) through its rollouts' cache (32 sequences x 1.25): at most 186 sequences at once,
    no preemption, its greedy tokens identical to one batch of 256's, in the same time (2026-12-02).
    Sampled answers differ from one batch's: vLLM draws a step's noise for the whole batch at once."""
    wanted = max(-(-rollout_sequences * rollouts_at_once // max(engines, 1)), 1)
    return min(wanted, CPU_MAX_SEQUENCES)


def cpu_kv_cache_bytes(sequences: int, max_seq_len: int, kv_bytes_per_token: int, tp: int, block_size: int) -> int:
    """Bytes of KV cache per CPU engine worker (each of `tp` holds its share of the heads; at least
    one whole sequence, which vLLM needs to start, and the floor)."""
    rounded = -(-max_seq_len // block_size) * block_size
    need = int(sequences * rounded * kv_bytes_per_token * CPU_KV_HEADROOM) // max(tp, 1)
    return max(need, rounded * kv_bytes_per_token, CPU_KV_CACHE_MIN_BYTES)


def kv_cache_args(kv_cache_bytes: Optional[int]) -> dict[str, int]:
    """`vllm.LLM` arguments for an engine's KV cache: `kv_cache_memory_bytes` (per GPU, or per CPU
    worker), or nothing: on GPUs vLLM then sizes it from gpu_memory_utilization."""
    return {} if kv_cache_bytes is None else {"kv_cache_memory_bytes": int(kv_cache_bytes)}


def skips_torch_compile(is_cpu: bool, enforce_eager: bool) -> bool:
    """An eager CPU engine runs vLLM's few `torch.compile`d sampler helpers eagerly too: compiling
    them (Dynamo trace + C++ build, or a cache load) cost ~5 s per engine process start, every
    start, for kernels that save nothing at CPU sizes. `engine.enforce_eager=false` keeps them."""
    return is_cpu and enforce_eager


#: Read by torch at import: the engine's own TP worker processes inherit it.
TORCH_COMPILE_OFF_ENV = {"TORCH_COMPILE_DISABLE": "1"}


#: Tokens per KV-cache block of a CPU engine when engine.block_size is null. vLLM's CPU backend
#: takes multiples of 32 and defaults to 128; prefix caching shares whole blocks only, so at 128 the
#: samples of a GRPO group recompute any prompt shorter than 128 tokens (and the last partial block
#: of longer ones). At 32 SmolLM2's 102-token prompts x 8 samples generated 2.5x faster (3.84 ->
#: 1.51 s a rollout) and 256-token answers 13 % faster (30.8 -> 26.8 s): docs/benchmarks.md.
CPU_BLOCK_SIZE_DEFAULT = 32


def kv_block_size(configured: Optional[int], is_cpu: bool) -> Optional[int]:
    """`vllm.LLM(block_size=...)`: engine.block_size, or (null) 32 on CPU, vLLM's own default on GPUs."""
    if configured is not None:
        return int(configured)
    return CPU_BLOCK_SIZE_DEFAULT if is_cpu else None


def sleep_level(configured: Optional[int], plan: PlacementPlan) -> int:
    """`engine.sleep_level`, or (null) `SLEEP_WHERE_AVAILABLE` where engines share GPUs with
    trainers, else 0."""
    if configured is not None:
        return int(configured)
    return SLEEP_WHERE_AVAILABLE if plan.layout == "colocated" and plan.total_gpus > 0 else NEVER_SLEEP


def cpu_thread_binding(cpus: list[int], tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `tp` CPU workers its own cores ("0|1", "0-3|4-7").

    vllm-cpu refuses to start TP workers without it on a machine with one NUMA node.
    """
    cpus = sorted(cpus)
    if len(cpus) < tp:
        raise RuntimeError(
            f"a tensor-parallel CPU engine needs one core per worker: engine_tp={tp} but this process may "
            f"use {len(cpus)} core(s) ({cpus}); lower placement.engine_tp"
        )
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(_core_range(g) for g in groups)


def _core_range(cores: list[int]) -> str:
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)
