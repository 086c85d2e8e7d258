"""Actors kept warm between the runs of one process (`launcher.keep_actors=true`).

Most of a short run's start-up is starting processes: an engine spends ~12 CPU-seconds importing
vLLM, each trainer rank ~7 importing torch, transformers and DeepSpeed (docs/benchmarks.md). Runs
started one after another in one process and one Ray session (`launcher.reuse_session=true`: a
notebook, a script of runs, a sweep, the test suite) can keep those processes. A run that completes
with every actor answering parks its actors and placement groups here (its chat endpoints closed,
nothing left generating); the next run whose `warm_key` is the same takes them and resets each to
what a new actor starts as (`VLLMEngine.reset`, `TrainerWorker.reset`), then builds them as new ones.
Anything else -- another plan, an actor that died or does not answer, a reset that fails, another
Ray session, a run with keep_actors=false -- kills what is parked. A failed or interrupted run
parks nothing. One run's worth is parked at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from rlhf_orch.engines.vllm_engine import EngineSpec
from rlhf_orch.orchestration.actors import RoleActors, not_answering
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.topology.ray_placement import RayPlacement

# How long a parked actor may take to answer before it counts as lost (it is idle when parked).
_ANSWER_TIMEOUT_S = 10.0


@dataclass
class _Parked:
    key: str
    session: str  # the Ray session and driver job the actors belong to
    placement: RayPlacement
    actors: RoleActors


_parked: _Parked | None = None


def warm_key(plan: PlacementPlan, engines: EngineSpec, kv_cache_gb: float | None, roles: Sequence[str]) -> str:
    """What actors must have been started with to serve a run: the plan (bundles, ranks, roles) and
    what an engine process fixes at its start (engine.kv_cache_gb as set, a threaded actor for
    several rollouts at once, eager mode -- which turns torch.compile off in the process --, its
    threads: engine.torch_threads, bound by vLLM at start).
    Everything else (the model, lengths, seeds, trainer settings, the KV-cache bytes derived for a
    CPU engine: part of EngineSpec, so a new `vllm.LLM` on reset) is set again by the resets."""
    return repr(
        (
            plan,
            kv_cache_gb,
            engines.max_concurrency,
            engines.tensor_parallel_size,
            engines.enforce_eager,
            engines.torch_threads,
            sorted(roles),
        )
    )


@contextmanager
def placement_for(
    key: str, plan: PlacementPlan, ready_timeout_s: float, keep: bool
) -> Iterator[tuple[RayPlacement, RoleActors | None]]:
    """The run's placement groups, with the actors in them when `keep` and a run before parked some
    under `key` (else None: new ones start); removed at the end unless the run parked them again."""
    taken = take(key) if keep else None
    if not keep:
        release()  # kept by an earlier run of this process: their groups would hold this run's resources
    if taken is not None:
        print("actors: kept from the previous run of this process, reset (launcher.keep_actors)", flush=True)
    placement, warm = taken or (RayPlacement(plan, ready_timeout_s=ready_timeout_s).create(), None)
    try:
        yield placement, warm
    finally:
        if not holds(placement):
            placement.remove()


def _session_id() -> str:
    """This process's Ray session: its node and driver job (a restarted or reconnected Ray is another)."""
    if not ray.is_initialized():
        return ""
    context = ray.get_runtime_context()
    return f"{context.get_node_id()}/{context.get_job_id()}"


def take(key: str) -> tuple[RayPlacement, RoleActors] | None:
    """The placement and actors parked under `key`, all answering, or None (nothing is parked after)."""
    global _parked
    parked, _parked = _parked, None
    if parked is None:
        return None
    try:
        if parked.session != _session_id():
            return None  # Ray was restarted: those actors and groups went with it
        if parked.key != key:
            print(
                "actors: the previous run's kept actors do not fit this run (another placement plan, roles or "
                "engine process settings): starting new ones",
                flush=True,
            )
        elif not_answering(parked.actors.all(), _ANSWER_TIMEOUT_S):
            print("actors: a kept actor of the previous run does not answer: starting new ones", flush=True)
        else:
            return parked.placement, parked.actors
    except BaseException:
        _kill(parked)
        raise
    _kill(parked)
    return None


def park(key: str, placement: RayPlacement, actors: RoleActors) -> bool:
    """Keep the actors of a run that completed for the next run; False (nothing kept) when one of
    them does not answer: the caller kills them as usual."""
    global _parked
    release()
    actors.close_endpoints()
    if not_answering(actors.all(), _ANSWER_TIMEOUT_S):
        return False
    _parked = _Parked(key, _session_id(), placement, actors)
    return True


def parked_actors() -> RoleActors | None:
    """The actors kept for the next run, if any."""
    return _parked.actors if _parked is not None else None


def holds(placement: RayPlacement) -> bool:
    """Whether `placement` is parked (its owner must not remove it)."""
    return _parked is not None and _parked.placement is placement


def release() -> None:
    """Kill what is parked and remove its placement groups (the session's resources are free again)."""
    global _parked
    parked, _parked = _parked, None
    if parked is not None and parked.session == _session_id():
        _kill(parked)


def _kill(parked: _Parked) -> None:
    parked.actors.kill()
    parked.placement.remove()
