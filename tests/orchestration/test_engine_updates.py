"""The engine side of weight updates without vLLM or Ray: `ping` on the engine's own thread, which
requests an update marks interrupted, and `pipeline.partial_rollout=false` holding an update until
the requests, agent sessions and multi-turn trajectories in flight finish. Split from
test_loop_consistency.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest


def test_a_threaded_engine_whose_vllm_thread_is_stuck_does_not_answer_ping():
    """pipeline=async engines are threaded Ray actors: a free Ray thread would answer `ping` while
    the thread running vLLM is stuck. `ping` runs on vLLM's thread, so a stuck one is not answering."""
    import concurrent.futures

    from rlhf_orch.engines.shared_steps import EngineThread, SharedEngineSteps
    from rlhf_orch.engines.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)  # no vLLM: only what ping needs
    thread = EngineThread()
    engine.index, engine.steps = (
        3,
        SharedEngineSteps(None, lambda: None, finish_before_update=False, engine_thread=thread),
    )
    assert engine.ping() == 3
    release = threading.Event()
    threading.Thread(target=thread.call, args=(release.wait,), daemon=True).start()  # vLLM's thread stuck
    answer = concurrent.futures.ThreadPoolExecutor(1).submit(engine.ping)
    with pytest.raises(concurrent.futures.TimeoutError):
        answer.result(timeout=0.5)
    release.set()
    assert answer.result(timeout=5) == 3


def test_a_weight_update_marks_only_the_requests_still_generating_interrupted():
    """`rollout/interrupted` counts sequences a weight update reached mid-generation; a request that
    finished just before the update, not yet taken by its call, was made wholly with the old weights."""
    from rlhf_orch.engines.shared_steps import SharedEngineSteps

    steps = SharedEngineSteps(None, lambda: None, finish_before_update=False, engine_thread=None)
    outbox: list = []
    for key in ("finished", "generating"):
        steps._outboxes[key], steps._started_at[key] = outbox, 0
    outbox.append(SimpleNamespace(request_id="finished"))  # what `step` does with a finished request
    del steps._outboxes["finished"]
    with steps._cond:
        steps.mark_interrupted()
    steps._outboxes.pop("generating")
    outbox.append(SimpleNamespace(request_id="generating"))
    ready, versions, interrupted = steps.take_versioned(outbox)
    assert versions == {"finished": 0, "generating": 0} and interrupted == {"generating"}


def test_with_partial_rollout_false_an_update_waits_for_the_agent_sessions_in_flight():
    """env=agent under pipeline.partial_rollout=false: an agent session's model calls reach vLLM
    through the endpoint (not `enqueue`), so an update that finishes the requests in flight first
    must wait for the whole session -- and no session starts while it waits."""
    import concurrent.futures

    from rlhf_orch.engines.shared_steps import EngineThread, SharedEngineSteps

    steps = SharedEngineSteps(None, lambda: None, finish_before_update=True, engine_thread=EngineThread())
    pool = concurrent.futures.ThreadPoolExecutor(2)
    steps.session_starts()
    update = pool.submit(steps.finish_in_flight)
    with pytest.raises(concurrent.futures.TimeoutError):
        update.result(timeout=0.3)  # the session is still running
    second = pool.submit(steps.session_starts)
    steps.session_ends()
    update.result(timeout=5)  # the session ended: the update goes
    with pytest.raises(concurrent.futures.TimeoutError):
        second.result(timeout=0.3)  # no new session while the update is being made
    with steps._cond:
        steps._closed = False  # what update_landed does
        steps._cond.notify_all()
    second.result(timeout=5)


def test_with_partial_rollout_false_no_update_lands_between_two_turns_of_a_trajectory():
    """Turn-driven multi-turn rollouts (env=python_tool, skyrl, ...) under partial_rollout=false:
    between two turns no request is in flight, so an update that only waited for the requests
    would land mid-trajectory. The rollout counts as a session: the update waits for its end, and
    its next turn is not held back by the update waiting (no deadlock)."""
    import concurrent.futures

    from rlhf_orch.engines.rollouts import VLLMRollouts
    from rlhf_orch.engines.shared_steps import EngineThread, SharedEngineSteps

    # no vLLM: the trajectories are a stand-in generator
    steps = SharedEngineSteps(None, lambda: None, finish_before_update=True, engine_thread=EngineThread())
    steps.enqueue = lambda prompts, params, outbox: ["turn-2"]
    rollouts = VLLMRollouts(None, 0, steps, agents=None)
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def two_turns(requests, job, seed):
        yield [SimpleNamespace(weight_version=None)]  # a trajectory out after its first turns
        update = pool.submit(steps.finish_in_flight)  # an update asked for between two turns
        with pytest.raises(concurrent.futures.TimeoutError):
            update.result(timeout=0.3)  # it waits for this rollout's trajectories
        assert steps.stepping().enqueue(["prompt"], None, []) == ["turn-2"]  # the next turn is not held back
        yield [SimpleNamespace(weight_version=None)]

    rollouts._complete_turns = two_turns
    out = list(rollouts._complete_env([], SimpleNamespace(env=SimpleNamespace(calls_through_endpoint=False))))
    assert [c.weight_version for item in out for c in item] == [0, 0]  # every turn with the version it started with
    pool.shutdown(wait=True)  # the update went once the rollout ended
    assert steps._closed


def test_an_engine_s_agent_rollout_holds_back_an_update_that_waits_for_the_requests_in_flight():
    """The engine's agent path (`VLLMRollouts._complete_env`, env=agent) counts its session: an update under
    partial_rollout=false waits until the rollout's trajectories are all out, and goes then."""
    import concurrent.futures

    from rlhf_orch.engines.rollouts import VLLMRollouts
    from rlhf_orch.engines.shared_steps import EngineThread, SharedEngineSteps

    # no vLLM: the agent session is a stand-in generator
    steps = SharedEngineSteps(None, lambda: None, finish_before_update=True, engine_thread=EngineThread())
    rollouts = VLLMRollouts(None, 0, steps, agents=None)
    rollouts._complete_agents = lambda requests, job, seed: iter(
        [[SimpleNamespace(weight_version=None)], [SimpleNamespace(weight_version=None)]]
    )
    trajectories = rollouts._complete_env([], SimpleNamespace(env=SimpleNamespace(calls_through_endpoint=True)))
    next(trajectories)  # the first trajectory is out, the session goes on
    update = concurrent.futures.ThreadPoolExecutor(1).submit(steps.finish_in_flight)
    with pytest.raises(concurrent.futures.TimeoutError):
        update.result(timeout=0.3)
    assert len(list(trajectories)) == 1  # the rest of the session
    update.result(timeout=5)
