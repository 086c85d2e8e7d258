"""Agents written in their frameworks, unchanged, through the `env=agent` endpoint: the examples in
scripts/examples/ (a streamed call then one at its own sampling settings; an OpenAI Agents SDK agent
on its default Responses API; LangGraph's prebuilt tool-calling agent over ChatOpenAI), each played
for one rollout on a real `ChatServer` and agent processes, with a scripted engine whose first
answer is a tool call (Hermes style, as a Qwen-style model writes it) and whose second is the
answer. No vLLM here: the same agents train on a real engine in docs/environments.md's runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlhf_orch.data.base import Prompt
from rlhf_orch.engines.agent_rollout import AgentRolloutSession, CallOutput
from rlhf_orch.env.agent import agent_row
from rlhf_orch.env.agent_driver.chat_server import ChatServer
from rlhf_orch.env.agent_driver.record import AgentLimits
from rlhf_orch.env.agent_driver.runner import AgentRunner
from tests.env.agent_fakes import EchoTokenizer, ScriptedGenerator

EXAMPLES = Path(__file__).resolve().parents[2] / "scripts" / "examples"
TOOL_CALL = '<tool_call>{"name": "lookup", "arguments": {"record": "3 1 4"}}</tool_call>'


class ToolThenAnswer(ScriptedGenerator):
    """Odd calls: a call of the lookup tool; even calls: the answer the tool gave."""

    def submit(self, key, prompt_ids, max_tokens, seed, stop, sampling=None):
        super().submit(key, prompt_ids, max_tokens, seed, stop, sampling)
        text = TOOL_CALL if len(self.submitted) % 2 else "it is 7"
        ids = [ord(c) for c in text] + [0]
        self.pending[-1] = CallOutput(key, ids, [-0.5] * len(ids), "stop")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def server():
    s = ChatServer("127.0.0.1", "policy")
    yield s
    s.close()


def _play(server, fn):
    limits = AgentLimits(max_prompt_tokens=4000, max_response_tokens=4000, max_tokens_per_call=200, max_calls=6)
    runner = AgentRunner(fn, concurrency=2, timeout_s=60.0)
    generator = ToolThenAnswer()
    session = AgentRolloutSession(server, generator, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 60.0)
    row = agent_row(Prompt(text="find 3 1 4 =", label="7", extra={"record": "3 1 4"}))
    (result,) = session.run([(0, row)])
    return result, generator


def test_a_streamed_call_then_one_at_its_own_sampling(server):
    result, generator = _play(server, _load("streamed_agent").streamed_then_sampled)
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.outcome.metrics["completion_tokens"] == result.record.counts.completion_tokens  # the usage chunk
    first, second = generator.sampling
    assert first.temperature is None and (second.temperature, second.top_p) == (0.7, 0.9)
    assert result.record.counts.calls == 2
    temperatures = [t for s in result.record.sequences for t in s.temperatures if t]
    assert set(temperatures) == {0.7}  # the second call's tokens are trained at its temperature


def test_an_openai_agents_sdk_agent_on_the_responses_api(server):
    pytest.importorskip("agents")
    result, generator = _play(server, _load("agents_sdk_agent").agents_sdk_agent)
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.record.counts.calls == 2 and result.record.counts.refused_calls == 0
    # the second call's prompt holds the tool's answer, as the SDK sent it back (function_call_output)
    second = "".join(chr(t) for t in generator.submitted[1][1])
    assert "t: got 7 =|" in second


def test_a_langgraph_prebuilt_agent_over_chat_openai(server):
    pytest.importorskip("langgraph")
    result, generator = _play(server, _load("langgraph_agent").langgraph_agent)
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.record.counts.calls == 2 and result.record.counts.refused_calls == 0
    second = "".join(chr(t) for t in generator.submitted[1][1])
    assert "t: got 7 =|" in second
