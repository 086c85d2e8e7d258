"""The engine actor's side of a weight update without vLLM: what every strategy's step gets around
it (generation paused while an update is open, the version published once it lands)."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_orch.engines.shared_steps import SharedEngineSteps
from rlhf_orch.engines.sleep_wake import SleepWake
from rlhf_orch.engines.weight_receiving import WeightReceiving
from rlhf_orch.sync.receive import CloseSession, OpenSession


class FakeLLM:
    def __init__(self):
        self.calls: list[tuple] = []
        self.llm_engine = SimpleNamespace(set_weight_version=lambda v: self.calls.append(("version", v)))

    def collective_rpc(self, name, args=()):
        self.calls.append((name, type(args[0]).__name__))
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))


def test_an_update_pauses_generation_until_its_version_is_published():
    llm = FakeLLM()
    power = SleepWake(llm, level=0, index=0)
    steps = SharedEngineSteps(llm, power.weights_present, finish_before_update=False, engine_thread=None)
    weights = WeightReceiving(llm, steps, power, index=0, workers_elsewhere=False)
    steps._outboxes["generating"], steps._started_at["generating"] = [], 0
    assert weights.receive(OpenSession()) is None
    assert steps._updating and steps.weight_version == 0
    report = weights.receive(CloseSession(7))
    assert llm.calls == [
        ("rlhf_receive", "OpenSession"),
        ("rlhf_receive", "CloseSession"),
        ("reset_prefix_cache", True),
        ("version", "7"),
    ]
    assert not steps._updating and steps.weight_version == 7 and steps._interrupted == {"generating"}
    assert report["engine"] == 0 and report["version"] == 7 and report["bytes"] == 0
