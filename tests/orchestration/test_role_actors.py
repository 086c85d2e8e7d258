"""`RoleActors`: an engine replacement that is still starting when the attempt ends (a rollout
thread blocked in its Ray calls meanwhile) never leaves a live engine behind in a bundle the next
attempt needs; the trainers' start-up, left running while step 1 generates (`TrainerStart`), is
waited for once, and its failure or a stop signal during it ends the start-up as before any step."""

from __future__ import annotations

import threading

import pytest
import ray

from rlhf_orch.orchestration import actors as actors_module
from rlhf_orch.orchestration.actors import ActorStartError, RoleActors, RunEnding, StartupStopped, TrainerStart


class _Engine:
    def __init__(self, name: str):
        self.name = name
        self.ping = self

    def remote(self):
        return self


def test_a_replacement_starting_when_the_actors_are_killed_is_killed_too(monkeypatch):
    killed: list[str] = []
    pinged, release = threading.Event(), threading.Event()

    def get(ref, timeout=None):
        pinged.set()
        release.wait(10)  # the new engine is starting (its ping not answered yet)
        return 0

    monkeypatch.setattr(actors_module.ray, "kill", lambda actor: killed.append(actor.name))
    monkeypatch.setattr(actors_module.ray, "get", get)
    actors = RoleActors(engines=[_Engine("old")], start_engine=lambda e: _Engine("new"), startup_timeout_s=600.0)
    outcome: list[BaseException] = []

    def replace() -> None:
        try:
            actors.restart_engine(0)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=replace)
    thread.start()
    assert pinged.wait(10)
    actors.kill()  # the attempt ends while the replacement starts
    release.set()
    thread.join(10)
    assert "new" in killed and isinstance(outcome[0], RunEnding)
    assert actors.engines[0].name == "old"  # never handed to the run
    with pytest.raises(RunEnding):  # and nothing starts after the kill
        actors.restart_engine(0)
    assert killed.count("new") == 1


class _Trainer:
    def __init__(self, name: str):
        self.name = name


def _start(monkeypatch, answers: list, killed: list[str], stopped=lambda: False):
    """A TrainerStart over one trainer whose start-up calls end as `answers` says, one answer per
    look (`ray.wait` finds a call ready; `ray.get` returns it or raises what it holds)."""
    looks = iter(answers)

    def get(refs, timeout=None):
        for ref in refs if isinstance(refs, list) else [refs]:
            if isinstance(ref, BaseException):
                raise ref
        return refs

    def wait(refs, num_returns=1, timeout=None):
        answer = next(looks, None)
        return ([answer], [r for r in refs if r != "build"]) if answer is not None else ([], list(refs))

    monkeypatch.setattr(actors_module.ray, "kill", lambda actor: killed.append(actor.name))
    monkeypatch.setattr(actors_module.ray, "wait", wait)
    monkeypatch.setattr(actors_module.ray, "get", get)
    actors = RoleActors(policy=[_Trainer("policy")], startup_timeout_s=600.0)
    actors.trainer_start = TrainerStart(actors, ["build"], 600.0, stopped)
    return actors


def test_the_trainers_start_up_is_waited_for_once(monkeypatch):
    """The builds go on while step 1 generates; the first thing that needs the trainers waits for
    them, every later ask returns at once (nothing is waited for twice)."""
    killed: list[str] = []
    actors = _start(monkeypatch, ["build"], killed)
    assert actors.trainer_start.pending
    actors.trainer_start.wait()
    assert not actors.trainer_start.pending and not killed
    monkeypatch.setattr(actors_module.ray, "wait", lambda *a, **k: pytest.fail("waited again"))
    actors.trainer_start.wait()


def test_a_trainer_that_dies_while_starting_is_the_start_up_s_failure_and_stays_it(monkeypatch):
    """A rank that died building (found at step 1's hand-over) fails the start-up as before any
    step: every actor killed, ActorStartError naming it; asked again, the same error."""
    killed: list[str] = []
    died = ray.exceptions.RayActorError()
    actors = _start(monkeypatch, [died], killed)
    with pytest.raises(ActorStartError, match="an actor died while starting") as first:
        actors.trainer_start.wait()
    assert killed == ["policy"] and actors.trainer_start.failed is first.value
    with pytest.raises(ActorStartError) as again:
        actors.trainer_start.wait()
    assert again.value is first.value and not actors.trainer_start.pending


def test_a_stop_signal_while_the_trainers_start_stops_the_start_up(monkeypatch):
    """SIGTERM while step 1 waits for the trainers' builds: the actors are killed at once, not
    waited for (StartupStopped: the run ends as stopped during start-up)."""
    killed: list[str] = []
    actors = _start(monkeypatch, [], killed, stopped=lambda: True)
    with pytest.raises(StartupStopped):
        actors.trainer_start.wait()
    assert killed == ["policy"]
