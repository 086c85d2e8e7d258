"""`RoleActors`: an engine replacement that is still starting when the attempt ends (a rollout
thread blocked in its Ray calls meanwhile) never leaves a live engine behind in a bundle the next
attempt needs."""

from __future__ import annotations

import threading

import pytest

from rlhf_orch.orchestration import actors as actors_module
from rlhf_orch.orchestration.actors import RoleActors, RunEnding


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
