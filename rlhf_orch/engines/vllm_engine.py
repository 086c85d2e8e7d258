"""A vLLM engine as a Ray actor: generate rollouts, receive weights, report its weight version."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import ray

from rlhf_orch.engines.adapter_serving import AdapterServingLLM, peft_helper_dict, serves_adapter, vllm_lora_args
from rlhf_orch.engines.launch import (
    SLEEP_WHERE_AVAILABLE,
    TORCH_COMPILE_OFF_ENV,
    CPU_KV_CACHE_UNSIZED_BYTES,
    kv_cache_args,
    kv_block_size,
    skips_torch_compile,
)
from rlhf_orch.engines.shared_steps import SharedEngineSteps, mean_version
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.liveness import MONITOR, actor_class
from rlhf_orch.sync.buckets import Bucket, TensorMeta
from rlhf_orch.sync.group import GroupAddress
from rlhf_orch.transfer.engine_side import Completion, RolloutJob, RolloutProducer
from rlhf_orch.transfer.plan import CompletionRequest


@dataclass
class EngineSpec:
    """Everything an engine needs to start; built on the driver from the config."""

    model_path: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_cache_bytes: int | None = None  # per GPU / CPU worker (session.engine_kv_cache_bytes); None: vLLM sizes it (GPUs)
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    block_size: int | None = None  # engine.block_size (rlhf_orch.engines.launch.kv_block_size)
    enforce_eager: bool = True
    # vLLM's executor for tensor-parallel workers: "ray" on GPUs (workers in the engine's planned
    # bundles, see rlhf_orch.engines.launch), "mp" on CPU (worker processes); None at TP 1.
    distributed_executor_backend: str | None = None
    sleep_level: int = 0  # vLLM sleep between a rollout and the next weight sync (0: never; -1: where available)
    max_concurrency: int = 1  # rollouts generated at once (the Ray actor's max_concurrency; pipeline=async)
    # A weight update waits until the requests in flight finish (no new one starts meanwhile):
    # every sequence is drawn by one version (pipeline.partial_rollout=false).
    finish_before_update: bool = False
    # model.lora: with its sync resolved to adapter (`serves_adapter`), vLLM serves the base with
    # the policy's adapter and each update carries the adapter's tensors only
    # (rlhf_orch.engines.adapter_serving); merged, or None: every weight, as without LoRA.
    lora: LoraSettings | None = None


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
    missing = [f"LLM.{name}" for name in ("enqueue", "collective_rpc", "sleep", "wake_up", "reset_prefix_cache") if not hasattr(LLM, name)]
    try:
        layerwise = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
        missing += [f"layerwise.{n}" for n in ("initialize_layerwise_reload", "finalize_layerwise_reload") if not hasattr(layerwise, n)]
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


class VLLMEngine(RolloutProducer, SharedEngineSteps):
    """Wraps `vllm.LLM` in the actor's own process (no extra engine-core process).

    As a `RolloutProducer` it also builds, scores and hands over experience itself (see
    `rlhf_orch.transfer.engine_side`): it supplies `_complete` and `_decode` below.

    Started with `spec.max_concurrency` > 1 (pipeline=async, a threaded Ray actor), several
    rollouts generate at once, sharing every engine step (`SharedEngineSteps`).
    """

    def __init__(self, spec: EngineSpec, engine_index: int):
        self._build(spec, engine_index)

    def _build(self, spec: EngineSpec, engine_index: int, engine_thread: Any = None) -> None:
        """A `vllm.LLM` for `spec` in this process (`engine_thread`: the one a threaded actor keeps)."""
        self._given_spec = spec
        # Keep the engine core in this process so Ray's placement and GPU ids apply to it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        check_vllm_interfaces()
        from vllm import LLM

        self.index = engine_index
        self.weight_version = 0
        self._start_generation_state(spec, engine_thread)
        if spec.sleep_level == SLEEP_WHERE_AVAILABLE:
            from vllm.platforms import current_platform

            spec = replace(spec, sleep_level=1 if current_platform.is_sleep_mode_available() else 0)
        self.spec = spec
        self._asleep = False
        self._weights_dropped = False  # slept at level 2; a finished weight update loads them again
        extra: dict[str, Any] = {}
        if spec.distributed_executor_backend:
            extra["distributed_executor_backend"] = spec.distributed_executor_backend
        if spec.sleep_level > 0:
            extra["enable_sleep_mode"] = True
        from vllm.platforms import current_platform

        extra.update(kv_cache_args(spec.kv_cache_bytes if spec.kv_cache_bytes is not None or not current_platform.is_cpu()
                                   else CPU_KV_CACHE_UNSIZED_BYTES))
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
        self.serves_adapter = spec.lora is not None and serves_adapter(spec.lora, spec.model_path)
        if self.serves_adapter:
            extra.update(vllm_lora_args(spec.lora, spec.model_path))
        if spec.tensor_parallel_size > 1 and spec.distributed_executor_backend == "mp":
            _bind_cpu_workers(spec.tensor_parallel_size)
        # vLLM's start-up runs gc.collect() five times over everything imported so far (torch,
        # transformers, vLLM): 1.3-1.4 s of the engine's start, on every run's critical path.
        # Freezing that heap first (what vLLM itself does once it has started) leaves the
        # collections only the objects made since: LLM(...) of the tiny model 3.4 s -> 1.7 s.
        gc.freeze()
        self.llm = LLM(
            model=spec.model_path,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            tensor_parallel_size=spec.tensor_parallel_size,
            seed=spec.seed + engine_index,
            enforce_eager=spec.enforce_eager,
            enable_prefix_caching=spec.enable_prefix_caching,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            worker_extension_cls="rlhf_orch.engines.worker_extension.WeightSyncWorkerExtension",
            # Sampled tokens' log-probs of the distribution sampled from (after temperature), the
            # one the trainers score (logits / temperature): truncated IS divides one by the other.
            logprobs_mode="processed_logprobs",
            **extra,
        )
        if self.serves_adapter:
            self.llm = AdapterServingLLM(self.llm)
            self.llm.collective_rpc("rlhf_serve_adapter", args=(peft_helper_dict(spec.lora),))
        # vLLM labels every output token with the weight version that sampled it (spans per
        # completion): the per-token staleness of a sequence a weight update reached mid-way.
        self.llm.llm_engine.set_weight_version("0")
        # What a run adds later (held rollouts, the step's seed, the chat server) is dropped by `reset`.
        self._attrs_at_start = frozenset(self.__dict__) | {"_attrs_at_start"}

    # ------------------------------------------------------------------ sleep / wake (colocated GPUs)
    def _awake(self) -> None:
        """Before any use of the GPU: wake a sleeping engine (KV cache reallocated; at level 1 the
        weights come back from CPU memory, at level 2 they are gone until a sync loads them)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _weights_present(self) -> None:
        """Before sampling or scoring with the weights: refuse weights level 2 dropped."""
        self._awake()
        if self._weights_dropped:
            raise RuntimeError(
                f"engine {self.index} dropped its weights (engine.sleep_level=2) and no weight sync has loaded them "
                "since: the driver must sync before it generates"
            )

    def sleep(self) -> None:
        """The trainers train next and this engine is idle until the sync: release its GPU memory
        (vLLM's levels; `spec.sleep_level`, 0 = never). The driver calls it, not a rollout: the
        engine cannot know whether more generation (dynamic sampling's next round, an evaluation)
        comes before the next sync, which level 2 needs to get its weights back."""
        self._run(self._sleep)

    def _sleep(self) -> None:
        if self.spec.sleep_level > 0 and not self._asleep:
            self.llm.sleep(level=self.spec.sleep_level)
            self._asleep = True
            self._weights_dropped = self._weights_dropped or self.spec.sleep_level == 2

    def is_asleep(self) -> bool:
        return self._asleep

    # ------------------------------------------------------------------ generation (RolloutProducer)
    def _complete(self, requests, job: RolloutJob):
        """Continuous batching over all `requests`; yields each request's completions as it finishes
        (multi-turn trajectories when the job has an environment: `rlhf_orch.engines.turns`)."""
        if job.env is not None:
            yield from self._complete_env(requests, job)
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # No per-request seed: with one, vLLM draws the n samples of a prompt identically. The
        # engine's own seed (LLM(seed=...)) makes runs reproducible instead.
        params = [
            SamplingParams(
                n=r.count, max_tokens=job.max_tokens, min_tokens=max(job.min_tokens, _min_response_len(job.prompts[r.prompt_index])),
                temperature=job.temperature, logprobs=0, detokenize=False,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=job.prompt_ids[r.prompt_index]) for r in requests]
        outbox: list[Any] = []  # this call's finished outputs, filled by whichever call steps vLLM
        by_id: dict[str, CompletionRequest] = dict(zip(self._submit(prompts, params, outbox), requests))
        try:
            while by_id:
                if not outbox and not self._advance() and not outbox:
                    break  # vLLM has nothing left, and none of ours came back
                ready, versions, interrupted = self._take_versioned(outbox)
                for out in ready:
                    key = str(out.request_id)
                    request = by_id.pop(key)
                    first = request.indices(job.samples_per_prompt).start
                    prompt_ids = list(out.prompt_token_ids)
                    completions = []
                    for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                        ids = list(comp.token_ids)
                        lps = [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], ids)]
                        completions.append(Completion(
                            first + j, prompt_ids, ids, lps, truncated=comp.finish_reason == "length",
                            weight_version=versions[key], interrupted=key in interrupted,
                            token_version_mean=mean_version(comp.weight_versions, versions[key]),
                        ))
                    yield completions
        finally:
            self._forget(list(by_id))  # a call that failed or was abandoned leaves nothing behind
        if by_id:
            raise RuntimeError(f"vLLM finished without answering {len(by_id)} request(s)")

    def _complete_env(self, requests, job: RolloutJob):
        """Multi-turn trajectories. `turns`: the driver runs on this (the caller's) thread and
        shares the engine's steps with the other rollouts in flight (`_stepping`). `agent`: its
        endpoint takes every output vLLM gives, so it runs on vLLM's thread, one rollout at a
        time on this engine. A weight update may land between two steps; a trajectory's staleness
        counts from the version it started with."""
        seed = getattr(self, "_step_seed", self.spec.seed)
        self._session_starts()  # (after any update it had to wait for)
        started = self.weight_version
        try:
            if not job.env.calls_through_endpoint:
                self._run(self._weights_present)
                for item in self._complete_turns(requests, job, seed):
                    yield self._stamped(item, started)
                return
            with self._env_rollout:

                def start():
                    self._weights_present()
                    return self._complete_agents(requests, job, seed)

                trajectories = self._run(start)
                done = object()
                while True:
                    item = self._run(next, trajectories, done)
                    if item is done:
                        return
                    yield self._stamped(item, started)
        finally:
            self._session_ends()

    def _stamped(self, completions: list[Completion], started: int) -> list[Completion]:
        for c in completions:
            if c.weight_version is None:
                c.weight_version = started
                c.interrupted = self.weight_version != started
        return completions

    def _complete_turns(self, requests, job: RolloutJob, step_seed: int):
        from rlhf_orch.engines.turns import complete_trajectories

        return complete_trajectories(self.llm, requests, job, step_seed, self._stepping())

    def _complete_agents(self, requests, job: RolloutJob, step_seed: int):
        from rlhf_orch.engines.agent_rollout import complete_agent_trajectories

        return complete_agent_trajectories(self.llm, self._chat_server(job.env), self._agent_runner(job.env), requests, job, step_seed,
                                           self._count_step)

    def _agent_runner(self, env: Any) -> Any:
        """The agent functions' runner for `env`: its host process is started once and kept for
        the next rollouts (importing `openai` and the function there costs ~1 s)."""
        runner, made_for = getattr(self, "_agents", (None, None))
        wanted = (env.path, env.name, env.concurrency, env.timeout_s)
        if runner is None or made_for != wanted:
            from rlhf_orch.env.agent_driver.runner import AgentRunner

            if runner is not None:
                runner.close()
            runner = AgentRunner(env.load(), env.concurrency, env.timeout_s)
            self._agents = (runner, wanted)
        return runner

    def _chat_server(self, env: Any) -> Any:
        """The engine's `env=agent` endpoint, started at its first agent rollout, closed with the engine."""
        server = getattr(self, "_server", None)
        if server is None:
            from rlhf_orch.env.agent_driver.chat_server import ChatServer

            from rlhf_orch.env.agent_driver.chat_server import MAX_CONNECTIONS

            # each agent running at once may hold a few connections (its client's pool, calls fanned out)
            limit = max(MAX_CONNECTIONS, 4 * env.concurrency)
            server = self._server = ChatServer(_serving_host(env.host), env.served_model_name, max_connections=limit)
        return server

    def chat_endpoint(self) -> dict[str, Any] | None:
        """Where the agent endpoint listens (None before any agent rollout)."""
        server = getattr(self, "_server", None)
        return None if server is None else {"host": server.host, "port": server.port}

    def close_chat_endpoint(self) -> None:
        """Stop serving agents (the port is free when this returns) and their host process; the run is ending."""
        runner, _ = getattr(self, "_agents", (None, None))
        if runner is not None:
            runner.close()
            self._agents = (None, None)
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()
            self._server = None

    def reset(self, spec: EngineSpec) -> None:
        """What a new engine of `spec` starts as, for the next run of this process
        (`rlhf_orch.orchestration.warm_actors`). The same spec as before: the model's weights
        reloaded from disk, version 0, no cached prefix, no weight-sync group, no rollout state,
        awake, the sampler seeded as at start. Another spec (model, lengths, seed, caching): a new
        `vllm.LLM` in this process (vLLM's import, most of an engine's start-up, is not paid
        again). Refused while requests are in flight (the kept actors are then not used)."""
        from rlhf_orch.env.custom import forget_user_modules as forget_envs
        from rlhf_orch.reward.custom import forget_user_modules as forget_rewards

        self.close_chat_endpoint()
        forget_envs()  # the users' environment and reward files are imported afresh, as in a new process
        forget_rewards()
        if spec != self._given_spec:
            thread = self._engine_thread
            self._run(self._drop_llm)
            index = self.index
            self.__dict__.clear()
            gc.collect()  # the last engine's objects, before _build freezes the heap
            self._build(spec, index, thread)
            return

        def reset():
            self._refuse_in_flight()
            self._awake()
            self.llm.collective_rpc("rlhf_reset")
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.set_weight_version("0")

        self._run(reset)
        for name in set(self.__dict__) - self._attrs_at_start:  # held rollouts, the step's seed, ...
            del self.__dict__[name]
        self.weight_version = 0
        self._weights_dropped = False
        self._reset_generation_state()

    def _refuse_in_flight(self) -> None:
        """(vLLM's thread.) A reset must not cut a request or an agent rollout of the last run short."""
        if self.llm.llm_engine.has_unfinished_requests() or self._started_at or self._env_rollout.locked():
            raise RuntimeError(f"engine {self.index} still has requests in flight")

    def _drop_llm(self) -> None:
        """(vLLM's thread.) End this process's `vllm.LLM` and vLLM's process-wide state, so that
        another can start here (what vLLM's own tests do between engines in one process)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._refuse_in_flight()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()

    def reseed(self, seed: int) -> None:
        """Sampling from here on draws from `seed` (every worker of a tensor-parallel engine);
        multi-turn turns derive their own per-request seeds from it."""
        self._step_seed = seed
        self._run(lambda: self.llm.collective_rpc("rlhf_reseed", args=(seed,)))

    def _decode(self, token_ids):
        return self.llm.get_tokenizer().batch_decode([list(map(int, t)) for t in token_ids], skip_special_tokens=True)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first, as the engine's current weights score it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        self._wait_for_update()

        def score():
            self._weights_present()
            return self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)

        outs = self._run(score)
        result = []
        for seq, out in zip(sequences, outs):
            lps = out.prompt_logprobs[1:]
            result.append([lp[tok].logprob for lp, tok in zip(lps, seq[1:])])
        return result

    # ------------------------------------------------------------------ weights
    def join_weight_group(self, address: GroupAddress, rank_offset: int) -> list[int]:
        return self._run(lambda: self.llm.collective_rpc("rlhf_join_weight_group", args=(address, rank_offset)))

    def receive_buckets(
        self, buckets: list[Bucket], routes: list[tuple[str, int]], version: int, receive_ahead: int = 1, load: bool = True
    ) -> dict[str, Any]:
        """One call per update: stream every bucket (bucket i from group/rank routes[i]) into vLLM.

        `load=False` only profiles the transport (scripts/bench/bench_sync.py): the weights stay as they were.
        """
        self._finish_in_flight()

        def receive():
            self._awake()
            t0 = time.perf_counter()
            per_worker = self.llm.collective_rpc("rlhf_receive_buckets", args=(buckets, routes, receive_ahead, load))
            return per_worker, self._finish_update(version, sum(w["bytes"] for w in per_worker), t0, loaded=load)

        per_worker, report = self._run(receive)
        # Time this engine sat waiting for the wire (the rest of `seconds` is vLLM's load).
        report["wire_wait_s"] = max(w["wait_s"] for w in per_worker)
        return report

    def close_for_update(self) -> None:
        """(pipeline.partial_rollout=false, before a weight push.) No new request starts; returns
        once the requests in flight finished with the weights they started with. The driver waits
        for it by the engine's progress (`Route.on_engines`), so the push that follows -- bounded by
        sync.timeout_s on the trainers' side -- never waits behind a long generation."""
        self._finish_in_flight()

    def begin_update(self, buckets: list[Bucket] | None = None) -> None:
        self._finish_in_flight()
        with self._cond:
            self._updating = True  # generation pauses until finish_update

        def begin():
            self._awake()
            self.llm.collective_rpc("rlhf_begin_update", args=(buckets,))

        self._run(begin)

    def receive_tensor(self, meta: TensorMeta, src: int) -> int:
        def receive():
            self._awake()
            return sum(self.llm.collective_rpc("rlhf_receive_tensor", args=(meta, src)))

        return self._run(receive)

    def load_bucket(self, bucket: Bucket, payload: Any, capacity: int) -> int:
        """One handed-over bucket (object store ref, CUDA IPC handle) inside the open session."""
        if self.spec.tensor_parallel_size > 1:
            # TP workers may be processes outside Ray (vllm-cpu's `mp`): resolve references here.
            payload = _fetched(payload)
        return sum(self._run(lambda: self.llm.collective_rpc("rlhf_load_bucket", args=(bucket, payload, capacity))))

    def finish_update(self, version: int) -> dict[str, Any]:
        def finish():
            t0 = time.perf_counter()
            self.llm.collective_rpc("rlhf_finish_update")
            return self._finish_update(version, 0, t0)

        return self._run(finish)

    def receive_raw_broadcast(self, nbytes: int) -> float:
        """The benchmark's limit: one raw broadcast into a kept buffer (see PolicyWorker.send_raw_broadcast)."""
        def receive():
            self._awake()
            return max(self.llm.collective_rpc("rlhf_receive_raw", args=(nbytes,)))

        return self._run(receive)

    def drop_raw_broadcast_buffer(self) -> None:
        self._run(lambda: self.llm.collective_rpc("rlhf_drop_raw_buffer"))

    def _finish_update(self, version: int, nbytes: int, t0: float, loaded: bool = True) -> dict[str, Any]:
        # (vLLM's thread.) Cached prefixes were computed with the old weights: drop them, then
        # publish the version. Requests in flight go on with the new weights (pipeline=async):
        # vLLM preempts them, dropping the keys and values their tokens so far got from the old
        # weights, and recomputes those on their next step (AReaL's recompute) -- every token after
        # the update is drawn by the new weights alone.
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.weight_version = version
        self.llm.llm_engine.set_weight_version(str(version))
        self._weights_dropped = self._weights_dropped and not loaded  # every sync sends every weight
        with self._cond:
            self._mark_interrupted()
            self._updating = self._closed = False
            self._cond.notify_all()
        return {"engine": self.index, "version": version, "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def lora_sync_mode(self) -> str | None:
        """What a weight update must carry to this engine under model.lora: "adapter" (its tensors
        only) or "merged" (every weight); None without LoRA."""
        if self.spec.lora is None:
            return None
        return "adapter" if self.serves_adapter else "merged"

    def get_weight_version(self) -> int:
        return self.weight_version

    @ray.method(concurrency_group=MONITOR)
    def progress(self) -> int:
        """Engine steps made and samples scored so far. Answered on a thread of its own while a
        rollout runs (the driver's liveness check, `Route.wait_any`): a count that moves means
        tokens are being made or responses scored; one that stands, or no answer (a vLLM call
        holding the interpreter), means a stuck engine."""
        return self.steps_made + self.samples_scored.count

    def _sample_scored(self) -> None:
        self.samples_scored.tick()

    def ping(self) -> int:
        """The engine's index, from the thread that runs vLLM when the actor is threaded
        (pipeline=async): an engine whose vLLM thread is stuck does not answer (the failure
        checks count it lost), however many of its Ray threads are free."""
        return self._run(lambda: self.index)

    def placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i("engine", self.index)


def _min_response_len(prompt: Any) -> int:
    """The tokens this prompt's response runs at least (a task's long-tail profile; 0: none)."""
    return int(getattr(prompt, "min_response_len", 0) or 0)


def _serving_host(host: str) -> str:
    """env.host: the loopback interface (`auto`, `loopback`: every agent runs in a process this
    engine starts on its node, on any cluster), or this node's address (`node`: for agents that call from elsewhere)."""
    if host in ("auto", "loopback"):
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _fetched(payload: Any) -> Any:
    parts = getattr(payload, "parts", None)
    if parts is not None:
        return type(payload)({w: _fetched(p) for w, p in parts.items()})
    return payload.fetched() if hasattr(payload, "fetched") else payload


def _bind_cpu_workers(tp: int) -> None:
    """vllm-cpu's TP workers each need their own cores (it refuses to start otherwise)."""
    from rlhf_orch.engines.launch import cpu_thread_binding

    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), tp)


# The engine as a Ray actor: its calls run in the default group (one at a time, or
# spec.max_concurrency with pipeline=async); `progress` has a thread of its own so it answers while
# a generation runs.
VLLMEngineActor = actor_class(VLLMEngine)
