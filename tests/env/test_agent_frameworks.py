"""Agents written in their frameworks, unchanged, through the `env=agent` endpoint: the examples in
scripts/examples/ (a streamed call then one at its own sampling settings; an OpenAI Agents SDK agent
on its default Responses API; LangGraph's prebuilt tool-calling agent over ChatOpenAI), played
together in one rollout (one trajectory each, the frameworks imported once by the agents' host) on a
real `ChatServer` and agent processes, with a scripted engine whose answer to a prompt without the
tool's result is a tool call (Hermes style, as a Qwen-style model writes it) and with it the answer.
No vLLM here: the same agents train on a real engine in docs/environments.md's runs."""

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

pytest.importorskip("agents")
pytest.importorskip("langgraph")

EXAMPLES = Path(__file__).resolve().parents[2] / "scripts" / "examples"
TOOL_CALL = '<tool_call>{"name": "lookup", "arguments": {"record": "3 1 4"}}</tool_call>'
TOOL_RESULT = "t: got 7 =|"  # the lookup tool's answer, as the test tokenizer renders a tool message


class ToolThenAnswer(ScriptedGenerator):
    """A call of the lookup tool; once the prompt holds the tool's answer, the answer."""

    def submit(self, key, prompt_ids, max_tokens, seed, stop, sampling=None):
        super().submit(key, prompt_ids, max_tokens, seed, stop, sampling)
        text = "it is 7" if TOOL_RESULT in "".join(map(chr, prompt_ids)) else TOOL_CALL
        ids = [ord(c) for c in text] + [0]
        self.pending[-1] = CallOutput(key, ids, [-0.5] * len(ids), "stop")


def _example(module: str, function: str):
    spec = importlib.util.spec_from_file_location(module, EXAMPLES / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, function)


AGENTS = {
    "streamed": _example("streamed_agent", "streamed_then_sampled"),
    "agents_sdk": _example("agents_sdk_agent", "agents_sdk_agent"),
    "langgraph": _example("langgraph_agent", "langgraph_agent"),
}


def each_framework(row, client, base_url, api_key):
    """The row's framework's example agent (the three travel to the host with this function)."""
    import asyncio
    import inspect
    import os

    fn = AGENTS[row["extra_info"]["framework"]]
    kwargs = {"client": client, "base_url": base_url, "api_key": api_key}
    result = asyncio.run(fn(row, **kwargs)) if inspect.iscoroutinefunction(fn) else fn(row, **kwargs)
    score = result["score"] if isinstance(result, dict) else result
    tracing = os.environ.get("OPENAI_AGENTS_DISABLE_TRACING")  # the run keeps the SDK's traces home
    return {
        "score": score,
        "tracing_off": float(tracing == "1"),
        **({} if not isinstance(result, dict) else {k: v for k, v in result.items() if k != "score"}),
    }


@pytest.fixture(scope="module")
def played():
    server = ChatServer("127.0.0.1", "policy")
    try:
        limits = AgentLimits(max_prompt_tokens=4000, max_response_tokens=4000, max_tokens_per_call=200, max_calls=6)
        runner = AgentRunner(each_framework, concurrency=3, timeout_s=60.0)
        generator = ToolThenAnswer()
        session = AgentRolloutSession(server, generator, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 60.0)
        rows = [
            (i, agent_row(Prompt(text="find 3 1 4 =", label="7", extra={"record": "3 1 4", "framework": name})))
            for i, name in enumerate(AGENTS)
        ]
        results = {name: r for name, r in zip(AGENTS, session.run(rows))}
        yield results, generator
    finally:
        server.close()


def _second_prompts(generator) -> list[str]:
    return ["".join(map(chr, ids)) for _, ids, _, _ in generator.submitted if TOOL_RESULT in "".join(map(chr, ids))]


def test_a_streamed_call_then_one_at_its_own_sampling(played):
    results, generator = played
    result = results["streamed"]
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.outcome.metrics["completion_tokens"] == result.record.counts.completion_tokens  # the usage chunk
    assert result.record.counts.calls == 2
    own = [s for s in generator.sampling if s.temperature is not None]
    assert [(s.temperature, s.top_p) for s in own] == [(0.7, 0.9)]  # the second call's, and no other
    temperatures = [t for s in result.record.sequences for t in s.temperatures if t]
    assert set(temperatures) == {0.7}  # its tokens carry the temperature they were sampled at


def test_an_openai_agents_sdk_agent_on_the_responses_api(played):
    results, _ = played
    result = results["agents_sdk"]
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.record.counts.calls == 2 and result.record.counts.refused_calls == 0
    assert result.outcome.metrics["tracing_off"] == 1.0


def test_a_langgraph_prebuilt_agent_over_chat_openai(played):
    results, generator = played
    result = results["langgraph"]
    assert result.outcome.error is None and result.outcome.reward == 1.0, result.outcome
    assert result.record.counts.calls == 2 and result.record.counts.refused_calls == 0
    # each framework's second call held the tool's answer (the SDK's as a function_call_output)
    assert len(_second_prompts(generator)) == 3
