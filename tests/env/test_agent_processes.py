"""`env=agent`'s agent processes: a hung agent killed at its deadline, an agent that exits or crashes,
processes it leaves behind, a function the host cannot load, a host that dies."""

from __future__ import annotations

import os
import time

import pytest

from rlhf_orch.engines.agent_rollout import AgentRolloutSession
from rlhf_orch.env.agent_driver.record import AgentLimits
from rlhf_orch.env.agent_driver.runner import AgentHostError, AgentRunner

from tests.env.agent_fakes import EchoTokenizer, ScriptedGenerator, Seen, agent_rows, make_session


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def test_a_hung_agent_is_killed_at_its_deadline_and_the_next_trajectory_gets_its_whole_time(server):
    """env.concurrency=1, a plain agent function: trajectory 0's spins past env.timeout_s and its
    process is killed; trajectory 1's then runs with its whole timeout (counted from its own start,
    not from the rollout's) and scores. No trajectory's process is left, the host stays for the next rollout."""

    def agent(row, client, **kwargs):
        if row["prompt"] == "q0":
            while True:
                pass
        time.sleep(1.2)  # more than what trajectory 0 left of a deadline counted from the rollout's start
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1.0 if reply.choices[0].message.content else 0.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(agent, concurrency=1, timeout_s=2.0)
    session = AgentRolloutSession(server, ScriptedGenerator(), EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 5.0)
    try:
        results = {r.index: r for r in session.run(agent_rows(2))}
        assert results[0].outcome.timed_out and results[0].outcome.reward == 0.0
        assert not results[1].outcome.timed_out and results[1].outcome.reward == 1.0, results[1].outcome
        assert runner._host.poll() is None and _children(runner._host.pid) == []
    finally:
        runner.close()


def test_an_agent_that_exits_or_crashes_its_process_scores_zero_and_the_rest_go_on(server):
    """`os._exit(1)` in one trajectory's agent and a segfault in another's (a C extension
    crashing): those score 0 with the cause counted as an error; the other trajectories score, and
    the same runner serves the next rollout (the engine, were this inside it, is untouched)."""

    def agent(row, client, **kwargs):
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        if row["prompt"] == "q0":
            os._exit(1)
        if row["prompt"] == "q1":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return 1.0 if reply.choices[0].message.content else 0.0

    session, _ = make_session(agent, server)
    try:
        for _ in range(2):
            results = {r.index: r.outcome for r in session.run(agent_rows(3))}
            assert results[0].reward == 0.0 and "exited with code 1" in results[0].error
            assert results[1].reward == 0.0 and "SIGSEGV" in results[1].error
            assert results[2].reward == 1.0 and results[2].error is None
    finally:
        session.runner.close()


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """The process has ended and been reaped (no zombie left in the host either)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


def test_a_process_an_agent_leaves_behind_neither_holds_its_outcome_nor_outlives_it(tmp_path):
    """The agent forks a child that leaves its session and sleeps, holding every descriptor the
    agent had: the trajectory still ends when the agent returns (its outcome, not a timeout), and the
    left-behind child is killed (the host is its subreaper)."""
    seen = Seen(tmp_path)

    def agent(row, **kwargs):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            time.sleep(60)
            os._exit(0)
        while os.getpgid(pid) != pid:  # out of the agent's group before the agent returns
            time.sleep(0.01)
        seen["child"] = pid
        return 1.0

    runner = AgentRunner(agent, concurrency=2, timeout_s=20.0)
    try:
        runner.start([(0, {}, "http://127.0.0.1:9/v1", "k")])
        assert runner.wait(10)
        outcome = runner.outcomes[0]
        assert outcome.reward == 1.0 and not outcome.timed_out and outcome.seconds < 5, outcome
        assert _gone(seen["child"]), "the agent's detached child outlived its trajectory (or was left a zombie)"
    finally:
        runner.close()


def test_an_outcome_of_a_rollout_given_up_is_not_taken_for_the_next_one(tmp_path):
    """concurrency 1: rollout 1's trajectory 0 (slow, scores 5) is given up; rollout 2's
    trajectory 0 (fast, scores 1) queues behind it. Rollout 2 gets its own outcome, not the slow one's."""

    def agent(row, **kwargs):
        if row["kind"] == "slow":
            time.sleep(1.0)
            return 5.0
        return 1.0

    runner = AgentRunner(agent, concurrency=1, timeout_s=20.0)
    try:
        runner.start([(0, {"kind": "slow"}, "http://127.0.0.1:9/v1", "k")])
        time.sleep(0.3)  # running in the host
        runner.start([(0, {"kind": "fast"}, "http://127.0.0.1:9/v1", "k")])
        assert runner.wait(10)
        assert runner.outcomes[0].reward == 1.0, runner.outcomes[0]
    finally:
        runner.close()


class _LoadsNowhereElse:
    """Pickles, but raises when unpickled (in the agents' host)."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def _refuse_to_load():
    raise RuntimeError("this function cannot be loaded here")


def test_a_function_the_host_cannot_load_fails_the_rollout_with_the_reason():
    def agent(row, marker=_LoadsNowhereElse(), **kwargs):
        return 1.0

    runner = AgentRunner(agent, concurrency=1, timeout_s=5.0)
    try:
        runner.start([(0, {}, "http://127.0.0.1:9/v1", "k")])
        with pytest.raises(
            AgentHostError,
            match="could not be loaded in its process: RuntimeError: this function cannot be loaded here",
        ):
            runner.wait(10)
    finally:
        runner.close()


def test_a_host_that_dies_fails_its_rollout_and_the_next_rollout_starts_another(tmp_path):
    def agent(row, **kwargs):
        time.sleep(row["sleep"])
        return 1.0

    runner = AgentRunner(agent, concurrency=2, timeout_s=20.0)
    try:
        runner.start(
            [(0, {"sleep": 30}, "http://127.0.0.1:9/v1", "k"), (1, {"sleep": 30}, "http://127.0.0.1:9/v1", "k")]
        )
        time.sleep(0.3)
        os.kill(runner._host.pid, 9)
        runner._host.wait()  # (dead before the next start looks at it)
        assert runner.wait(10)
        assert all("host process ended" in runner.outcomes[i].error for i in (0, 1))
        runner.start([(0, {"sleep": 0}, "http://127.0.0.1:9/v1", "k")])
        assert runner.wait(20) and runner.outcomes[0].reward == 1.0, runner.outcomes
    finally:
        runner.close()
