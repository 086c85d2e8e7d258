"""A vLLM engine as a Ray actor: generate rollouts, receive weights, report its weight version.

The actor is a shell over parts that are plain classes, each one concern (the engine's process
holds them; the remote API below only hands each call to its part):

* `llm_start.start_llm`                 the `vllm.LLM` in this process (and vLLM's interface checks)
* `shared_steps.SharedEngineSteps`      vLLM's thread, and its steps shared by the rollouts in flight
* `rollouts.VLLMRollouts`               rollout production (`RolloutProducer`) and scoring passes
* `agent_serving.AgentServing`          the `env=agent` chat endpoint and the agents' host process
* `weight_receiving.WeightReceiving`    a sync strategy's steps (`rlhf_orch.sync.receive`), version publishing
* `sleep_wake.SleepWake`                vLLM's sleep between a rollout and the next sync (colocated GPUs)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Iterator

import ray

from rlhf_orch.engines.agent_serving import AgentServing
from rlhf_orch.engines.launch import NEVER_SLEEP
from rlhf_orch.engines.llm_start import start_llm
from rlhf_orch.engines.rollouts import VLLMRollouts
from rlhf_orch.engines.shared_steps import EngineThread, SharedEngineSteps
from rlhf_orch.engines.sleep_wake import SleepWake
from rlhf_orch.engines.weight_receiving import WeightReceiving
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.liveness import MONITOR, actor_class
from rlhf_orch.sync.group import GroupAddress
from rlhf_orch.sync.receive import EngineStep
from rlhf_orch.transfer.batch import Sample
from rlhf_orch.transfer.engine_side import MicroBatchTicket
from rlhf_orch.transfer.rollout_meta import RolloutMeta


@dataclass
class EngineSpec:
    """Everything an engine needs to start; built on the driver from the config."""

    model_path: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_cache_bytes: int | None = (
        None  # per GPU / CPU worker (session.engine_kv_cache_bytes); None: vLLM sizes it (GPUs)
    )
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    block_size: int | None = None  # engine.block_size (rlhf_orch.engines.launch.kv_block_size)
    enforce_eager: bool = True
    torch_threads: int = 1  # engine.torch_threads: the process's OMP_NUM_THREADS (set by the driver)
    # vLLM's executor for tensor-parallel workers: "ray" on GPUs (workers in the engine's planned
    # bundles, see rlhf_orch.engines.launch), "mp" on CPU (worker processes); None at TP 1.
    distributed_executor_backend: str | None = None
    sleep_level: int = (
        NEVER_SLEEP  # vLLM sleep between a rollout and the next weight sync (0: never; -1: where available)
    )
    max_concurrency: int = 1  # rollouts generated at once (the Ray actor's max_concurrency; pipeline=async)
    # A weight update waits until the requests in flight finish (no new one starts meanwhile):
    # every sequence is drawn by one version (pipeline.partial_rollout=false).
    finish_before_update: bool = False
    # model.lora: with its sync resolved to adapter (`serves_adapter`), vLLM serves the base with
    # the policy's adapter and each update carries the adapter's tensors only
    # (rlhf_orch.engines.adapter_serving); merged, or None: every weight, as without LoRA.
    lora: LoraSettings | None = None


class VLLMEngine:
    """Wraps `vllm.LLM` in the actor's own process (no extra engine-core process).

    It also builds, scores and hands over experience itself (`rollouts.VLLMRollouts`, a
    `RolloutProducer`: see `rlhf_orch.transfer.engine_side`). Started with `spec.max_concurrency` > 1
    (pipeline=async, a threaded Ray actor), several rollouts generate at once, sharing every engine
    step (`SharedEngineSteps`).
    """

    def __init__(self, spec: EngineSpec, engine_index: int):
        self._build(spec, engine_index)

    def _build(self, spec: EngineSpec, engine_index: int, engine_thread: EngineThread | None = None) -> None:
        """A `vllm.LLM` for `spec` in this process (`engine_thread`: the one a threaded actor keeps)."""
        self._given_spec = spec
        llm, resolved, serves_adapter = start_llm(spec, engine_index)
        self._assemble(llm, resolved, engine_index, serves_adapter, engine_thread)

    def _assemble(
        self,
        llm: Any,
        spec: EngineSpec,
        engine_index: int,
        serves_adapter: bool,
        engine_thread: EngineThread | None = None,
    ) -> None:
        """The engine's parts around `llm` (a started one, or a test's stand-in)."""
        self.llm, self.spec, self.index, self.serves_adapter = llm, spec, engine_index, serves_adapter
        self.power = SleepWake(llm, spec.sleep_level, engine_index)
        threaded = spec.max_concurrency > 1
        self.steps = SharedEngineSteps(
            llm,
            self.power.weights_present,
            finish_before_update=spec.finish_before_update,
            engine_thread=(engine_thread or EngineThread()) if threaded else None,
        )
        self.weights = WeightReceiving(
            llm, self.steps, self.power, engine_index, workers_elsewhere=spec.tensor_parallel_size > 1
        )
        self._start_run()

    def _start_run(self) -> None:
        """What a run adds and `reset` drops: held rollouts, the step's seed, the agents' endpoint."""
        self.agents = AgentServing()
        self.rollouts = VLLMRollouts(self.llm, self.spec.seed, self.steps, self.agents)

    # ------------------------------------------------------------------ rollouts (VLLMRollouts)
    # Each as `RolloutProducer` (rlhf_orch.transfer.engine_side) documents it.
    def produce_samples(self, *args: Any, **kwargs: Any) -> tuple[list[Sample], float]:
        return self.rollouts.produce_samples(*args, **kwargs)

    def produce_micro_batches(self, *args: Any, **kwargs: Any) -> Iterator[MicroBatchTicket]:
        yield from self.rollouts.produce_micro_batches(*args, **kwargs)  # a Ray streaming method

    def produce_and_hold(self, *args: Any, **kwargs: Any) -> RolloutMeta:
        return self.rollouts.produce_and_hold(*args, **kwargs)

    def produce_scores(self, *args: Any, **kwargs: Any) -> RolloutMeta:
        return self.rollouts.produce_scores(*args, **kwargs)

    def cut_for_ranks(self, *args: Any, **kwargs: Any) -> Any:
        return self.rollouts.cut_for_ranks(*args, **kwargs)

    def release_held(self, *args: Any, **kwargs: Any) -> None:
        self.rollouts.release_held(*args, **kwargs)

    def held_samples(self, *args: Any, **kwargs: Any) -> list[Sample]:
        return self.rollouts.held_samples(*args, **kwargs)

    def hold_samples(self, *args: Any, **kwargs: Any) -> None:
        self.rollouts.hold_samples(*args, **kwargs)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first, as the engine's current weights score it."""
        return self.rollouts.prompt_logprobs(sequences)

    def reseed(self, seed: int) -> None:
        """Sampling from here on draws from `seed` (every worker of a tensor-parallel engine);
        multi-turn turns derive their own per-request seeds from it."""
        self.rollouts.step_seed = seed
        self.steps.run(lambda: self.llm.collective_rpc("rlhf_reseed", args=(seed,)))

    # ------------------------------------------------------------------ weights (WeightReceiving)
    def join_weight_group(self, address: GroupAddress, rank_offset: int) -> list[int]:
        return self.weights.join(address, rank_offset)

    def receive_weights(self, step: EngineStep) -> Any:
        """One call of a weight update: the sync strategy's step (`rlhf_orch.sync.receive`)."""
        return self.weights.receive(step)

    def close_for_update(self) -> None:
        """(pipeline.partial_rollout=false, before a weight push.) No new request starts; returns
        once the requests in flight finished with the weights they started with. The driver waits
        for it by the engine's progress (`Route.on_engines`), so the push that follows -- bounded by
        sync.timeout_s on the trainers' side -- never waits behind a long generation."""
        self.steps.finish_in_flight()

    def get_weight_version(self) -> int:
        return self.steps.weight_version

    def lora_sync_mode(self) -> str | None:
        """What a weight update must carry to this engine under model.lora: "adapter" (its tensors
        only) or "merged" (every weight); None without LoRA."""
        if self.spec.lora is None:
            return None
        return "adapter" if self.serves_adapter else "merged"

    # ------------------------------------------------------------------ sleep / wake (colocated GPUs)
    def sleep(self) -> None:
        """The trainers train next and this engine is idle until the sync: release its GPU memory
        (vLLM's levels; `spec.sleep_level`, 0 = never). The driver calls it, not a rollout: the
        engine cannot know whether more generation (dynamic sampling's next round, an evaluation)
        comes before the next sync, which level 2 needs to get its weights back."""
        self.steps.run(self.power.sleep)

    # ------------------------------------------------------------------ agents (AgentServing)
    def chat_endpoint(self) -> dict[str, Any] | None:
        """Where the agent endpoint listens (None before any agent rollout)."""
        return self.agents.endpoint()

    def close_chat_endpoint(self) -> None:
        """Stop serving agents (the port is free when this returns) and their host process; the run is ending."""
        self.agents.close()

    # ------------------------------------------------------------------ the process
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
            thread = self.steps.engine_thread
            self.steps.run(self._drop_llm)
            index = self.index
            self.__dict__.clear()
            gc.collect()  # the last engine's objects, before _build freezes the heap
            self._build(spec, index, thread)
            return

        def reset():
            self._refuse_in_flight()
            self.power.awake()
            self.llm.collective_rpc("rlhf_reset")
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.set_weight_version("0")

        self.steps.run(reset)
        self.steps.weight_version = 0
        self.power.weights_dropped = False
        self.steps.reset_generation_state()
        self._start_run()  # no held rollout, step seed or agent endpoint of the last run

    def _refuse_in_flight(self) -> None:
        """(vLLM's thread.) A reset must not cut a request or an agent rollout of the last run short."""
        if self.steps.in_flight():
            raise RuntimeError(f"engine {self.index} still has requests in flight")

    def _drop_llm(self) -> None:
        """(vLLM's thread.) End this process's `vllm.LLM` and vLLM's process-wide state, so that
        another can start here (what vLLM's own tests do between engines in one process)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._refuse_in_flight()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        self.steps.llm = self.weights.llm = self.rollouts.llm = self.power.llm = None
        cleanup_dist_env_and_memory()

    @ray.method(concurrency_group=MONITOR)
    def progress(self) -> int:
        """Engine steps made and samples scored so far. Answered on a thread of its own while a
        rollout runs (the driver's liveness check, `Route.wait_any`): a count that moves means
        tokens are being made or responses scored; one that stands, or no answer (a vLLM call
        holding the interpreter), means a stuck engine."""
        return self.steps.steps_made + self.steps.samples_scored.count

    def ping(self) -> int:
        """The engine's index, from the thread that runs vLLM when the actor is threaded
        (pipeline=async): an engine whose vLLM thread is stuck does not answer (the failure
        checks count it lost), however many of its Ray threads are free."""
        return self.steps.run(lambda: self.index)

    def placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i("engine", self.index)


# The engine as a Ray actor: its calls run in the default group (one at a time, or
# spec.max_concurrency with pipeline=async); `progress` has a thread of its own so it answers while
# a generation runs.
VLLMEngineActor = actor_class(VLLMEngine)
