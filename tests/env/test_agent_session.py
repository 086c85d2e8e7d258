"""`env=agent`: a whole rollout session over real HTTP with the `openai` client (a scripted generator
stands in for vLLM; tests/env/test_env_integration.py runs the same on a real engine and in whole
runs): every call recorded, conversations, calls made at once, empty replies, the engine's liveness."""

from __future__ import annotations

import asyncio
import socket
import time

import openai
import pytest

from rlhf_orch.engines.agent_rollout import AgentRolloutSession, CallOutput, trajectory_completions
from rlhf_orch.engines.request_steps import turn_seed
from rlhf_orch.env.agent_driver.record import AgentLimits
from rlhf_orch.env.agent_driver.runner import AgentRunner
from rlhf_orch.transfer.plan import extra_sequence_index

from tests.env.agent_fakes import (
    EchoTokenizer,
    ScriptedGenerator,
    Seen,
    agent_rows,
    make_session,
    three_calls_with_a_tool,
)


def test_a_session_records_every_call_of_every_trajectory_as_one_sequence(server):
    session, gen = make_session(three_calls_with_a_tool, server)
    results = session.run(agent_rows(3))
    assert len(gen.submitted) == 9
    for r in results:
        assert r.outcome.error is None and r.outcome.reward == pytest.approx(r.index / 10)
        (seq,) = r.record.sequences
        text = EchoTokenizer().decode(seq.prompt_ids + seq.response_ids)
        assert text.startswith(f"u:q{r.index}|") and text.count("t:tool saw ") == 2
        assert r.record.counts.calls == 3 and r.record.counts.unmerged_calls == 0
        model_text = EchoTokenizer().decode([t for t, m in zip(seq.response_ids, seq.loss_mask) if m])
        assert model_text.isdigit() and sum(seq.loss_mask) == r.record.counts.completion_tokens
        # the model's tokens carry the engine's log-probs; context carries none
        assert all((lp == -0.5) == bool(m) for lp, m in zip(seq.logprobs, seq.loss_mask))
    # per-call seeds: from (step seed, trajectory, call number), the same whatever the order
    seeds = {s for *_, s in gen.submitted}
    assert len(seeds) == 9
    fields = dict(trajectory_completions(results, {i: [1] for i in range(3)}, eos_id=0))
    assert fields[2]["reward"] == pytest.approx(0.2) and fields[2]["stats"]["agent_metric/calls"] == 3.0


def test_an_async_agent_and_its_failures_are_counted_and_scored_zero(server):
    async def agent(row, client, **kwargs):
        if row["prompt"] == "q1":
            raise RuntimeError("the agent's bug")
        if row["prompt"] == "q2":
            await asyncio.sleep(30)
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1.0 if reply.choices[0].message.content else 0.0

    session, _ = make_session(agent, server, timeout_s=1.0)
    t = time.perf_counter()
    results = {r.index: r for r in session.run(agent_rows(3))}
    assert time.perf_counter() - t < 10
    assert results[0].outcome.reward == 1.0
    assert results[1].outcome.error == "RuntimeError: the agent's bug" and results[1].outcome.reward == 0.0
    assert results[2].outcome.timed_out and results[2].outcome.reward == 0.0
    # the two that made no model call train nothing and leave their group's statistics (masked)
    stats = {
        i: f["stats"] for i, f in trajectory_completions(list(results.values()), {i: [1] for i in range(3)}, eos_id=0)
    }
    assert [stats[i]["masked"] for i in range(3)] == [0.0, 1.0, 1.0]


def test_bad_requests_get_http_errors_and_the_server_leaves_no_listener(server, tmp_path):
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        def error(**kw):
            try:
                client.chat.completions.create(
                    **{"model": "policy", "messages": [{"role": "user", "content": "x"}], **kw}
                )
            except openai.APIStatusError as e:
                return e.status_code, e.message
            return 200, ""

        seen["n=0"] = error(n=0)
        seen["stream"] = error(stream=True, temperature=2.5)  # (a streamed call's refusal: JSON, its status)
        seen["model"] = error(model="another-model")
        seen["key"] = None
        try:
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        except openai.AuthenticationError as e:
            seen["key"] = (e.status_code, e.message)
        seen["models"] = [m.id for m in client.models.list()]
        seen["url"], seen["api_key"] = base_url, api_key
        return 0.0

    session, _ = make_session(agent, server)
    session.run(agent_rows(1))
    assert seen["n=0"][0] == 400 and "n=0" in seen["n=0"][1]
    assert seen["stream"][0] == 400 and "temperature=2.5" in seen["stream"][1]
    assert seen["model"][0] == 404 and "another-model" in seen["model"][1]
    assert seen["key"][0] == 401 and "API key" in seen["key"][1]
    assert seen["models"] == ["policy"]
    # after the rollout: the trajectory's URL answers 410 with a message
    late = openai.OpenAI(base_url=seen["url"], api_key=seen["api_key"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        late.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 410 and "ended" in e.value.message
    port = server.port
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def answer_then_check_in_a_new_conversation(row, client, **kwargs):
    """Two conversations: the answer, then a fresh one asking to check it (extends nothing)."""
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    answer = first.choices[0].message.content
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"check {answer}"}])
    return float(row["ground_truth"])


def test_every_conversation_of_a_trajectory_trains_with_its_reward(server):
    session, _ = make_session(answer_then_check_in_a_new_conversation, server)
    results = session.run(agent_rows(3))
    sequences = list(trajectory_completions(results, {i: [1] for i in range(3)}, eos_id=0))
    assert len(sequences) == 6
    by_index = dict(sequences)
    for r in results:
        assert r.record.counts.unmerged_calls == 1
        extra = extra_sequence_index(r.index, 1)
        first, second = by_index[r.index], by_index[extra]
        assert first["reward"] == second["reward"] == pytest.approx(r.index / 10)
        assert EchoTokenizer().decode(second["prompt_ids"]).startswith("u:check ")
        assert sum(second["loss_mask"]) == len(second["response_ids"]) > 0  # the model's reply trains
        # the trajectory's counters go with its first sequence only (the metrics divide by trajectories)
        assert first["stats"]["trajectories"] == 1.0 and second["stats"] is None


class SlowGenerator(ScriptedGenerator):
    """Answers each call `hold_s` after it arrived: calls made at once are all in flight together
    (what an agent fanning out with `asyncio.gather` does to the engine)."""

    def __init__(self, hold_s: float):
        super().__init__()
        self.hold_s, self.due = hold_s, []

    def submit(self, key, prompt_ids, max_tokens, seed, stop, sampling=None):
        super().submit(key, prompt_ids, max_tokens, seed, stop, sampling)
        self.due.append(time.perf_counter() + self.hold_s)

    def poll(self):
        now, out = time.perf_counter(), []
        while self.pending and self.due[0] <= now:
            out.append(self.pending.pop(0))
            self.due.pop(0)
        return out


def _fan_out_session(server, agent, limits):
    # concurrency 8: the client's connection pool (2 per trajectory at once) lets all 8 calls through
    runner = AgentRunner(agent, concurrency=8, timeout_s=30.0)
    gen = SlowGenerator(hold_s=1.0)
    return AgentRolloutSession(server, gen, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 30.0), gen


def test_calls_made_at_once_count_against_max_calls_while_in_flight(server, tmp_path):
    """env.max_calls=4 and an agent that fans out 8 calls at once: 4 answers, 4 refusals."""
    seen = Seen(tmp_path)

    async def fan_out(row, client, **kwargs):
        async def one(k):
            try:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"c{k}"}])
                return "answer"
            except openai.BadRequestError as e:
                assert "env.max_calls" in str(e)
                return "refused"

        seen["replies"] = await asyncio.gather(*(one(k) for k in range(8)))
        return 1.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    session, gen = _fan_out_session(server, fan_out, limits)
    (result,) = session.run(agent_rows(1))
    assert sorted(seen["replies"]) == ["answer"] * 4 + ["refused"] * 4, result.outcome
    assert len(gen.submitted) == 4 and result.record.counts.calls == 4 and result.record.counts.refused_calls == 4


def test_two_calls_at_once_on_one_conversation_fork_it(server, tmp_path):
    """Two calls at once that both extend one conversation (a tree-searching agent): both are
    answered, each recorded as its own sequence sharing the history -- neither starts a sequence past
    data.prompt_max_len, as a second call recorded after the first would have without forks."""
    seen = Seen(tmp_path)

    async def two_at_once(row, client, **kwargs):
        history = [{"role": "user", "content": "q" * 30}]
        first = await client.chat.completions.create(model="policy", messages=history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "tool", "content": "t"},
        ]

        async def extend(tag):
            reply = await client.chat.completions.create(
                model="policy", messages=[*history, {"role": "user", "content": tag}]
            )
            return reply.choices[0].message.content

        seen["extensions"] = sorted(await asyncio.gather(extend("a"), extend("b")))
        return 1.0

    limits = AgentLimits(max_prompt_tokens=40, max_response_tokens=400, max_tokens_per_call=8, max_calls=8)
    session, gen = _fan_out_session(server, two_at_once, limits)
    (result,) = session.run(agent_rows(1))
    assert seen.get("extensions") == ["2", "3"], result.outcome
    trunk, fork = result.record.sequences
    assert trunk.prompt_ids == fork.prompt_ids and len(trunk.prompt_ids) <= 40
    shared = len("1") + 1 + len("t:t|u:")  # the first answer and its EOS, the tool's turn, the user's header
    assert trunk.response_ids[:shared] == fork.response_ids[:shared]
    assert {chr(trunk.response_ids[shared]), chr(fork.response_ids[shared])} == {"a", "b"}
    counts = result.record.counts
    assert (counts.calls, counts.branches, counts.unmerged_calls, counts.refused_calls) == (3, 1, 0, 0)


def test_n_choices_are_branches_and_a_call_s_sampling_reaches_the_engine(server, tmp_path):
    """n=3 at temperature 0.7 / top_p 0.9 with a seed: three choices, three sequences of one prompt,
    each engine request with the call's settings and its own seed; each token trained at 0.7."""
    seen = Seen(tmp_path)

    def three_ways(row, client, **kwargs):
        reply = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "q"}],
            n=3,
            temperature=0.7,
            top_p=0.9,
            seed=5,
            presence_penalty=0.5,
        )
        seen["choices"] = [(c.index, c.message.content) for c in reply.choices]
        seen["usage"] = reply.usage.completion_tokens
        return 1.0

    limits = AgentLimits(max_prompt_tokens=40, max_response_tokens=400, max_tokens_per_call=8, max_calls=8)
    session, gen = _fan_out_session(server, three_ways, limits)
    (result,) = session.run(agent_rows(1))
    assert seen.get("choices") == [[0, "1"], [1, "2"], [2, "3"]], result.outcome
    assert seen["usage"] == 6  # a digit and EOS each
    # the call's seed, made the trajectory's (a group asking for one seed still draws apart)
    assert [s.seed for s in gen.sampling] == [5, 5, 5]
    assert [sub[3] for sub in gen.submitted] == [turn_seed(5, 0, k) for k in range(3)]
    assert {(s.temperature, s.top_p, s.presence_penalty) for s in gen.sampling} == {(0.7, 0.9, 0.5)}
    seqs = result.record.sequences
    assert len(seqs) == 3 and len({tuple(s.prompt_ids) for s in seqs}) == 1
    # top_p and a penalty without importance weights in the run: context, each at its temperature
    assert all(s.temperatures == [0.7, 0.7] and s.loss_mask == [0, 0] for s in seqs)
    assert (result.record.counts.calls, result.record.counts.branches) == (3, 2)
    assert result.record.counts.truncated_sampling_tokens == 6  # top_p 0.9 and a presence penalty
    assert result.record.counts.truncated_sampling_context_tokens == 6  # (the run corrects for nothing)


def test_the_engine_steps_an_agent_session_makes_count_for_the_engines_liveness(monkeypatch):
    """An agent session steps vLLM itself (no shared stepping): each step counts, so the driver's
    `progress` question sees a busy engine move while `ping` waits behind the session."""
    from types import SimpleNamespace

    from rlhf_orch.engines import agent_rollout
    from rlhf_orch.engines.request_steps import VLLMCalls
    from rlhf_orch.engines.rollouts import VLLMRollouts
    from rlhf_orch.engines.shared_steps import SharedEngineSteps
    from rlhf_orch.engines.vllm_engine import VLLMEngine

    vllm_engine = SimpleNamespace(step=lambda: [SimpleNamespace(finished=False)], has_unfinished_requests=lambda: True)
    counted: list[int] = []
    calls = VLLMCalls(SimpleNamespace(llm_engine=vllm_engine), 1.0, count_step=lambda: counted.append(1))
    for _ in range(3):
        assert calls.poll() == []
    assert len(counted) == 3
    # The engine hands the session its own count, the one `progress` answers.
    engine = object.__new__(VLLMEngine)  # no vLLM: only what an agent rollout's start needs
    engine.steps = SharedEngineSteps(None, lambda: None, finish_before_update=False, engine_thread=None)
    agents = SimpleNamespace(chat_server=lambda env: None, runner=lambda env: None)
    rollouts = VLLMRollouts(None, 0, engine.steps, agents)
    handed = {}
    monkeypatch.setattr(
        agent_rollout, "complete_agent_trajectories", lambda *args: handed.setdefault("count_step", args[-1])
    )
    rollouts._complete_agents([], SimpleNamespace(env=None), step_seed=0)
    handed["count_step"]()
    handed["count_step"]()
    assert engine.progress() == 2


class EmptyFirstReply(ScriptedGenerator):
    """The first call's completion is the end-of-turn token alone (an empty reply); later calls as
    ScriptedGenerator's."""

    def submit(self, key, prompt_ids, max_tokens, seed, stop, sampling=None):
        super().submit(key, prompt_ids, max_tokens, seed, stop, sampling)
        if len(self.submitted) == 1:
            self.pending[-1] = CallOutput(key, [0], [-0.5], "stop")


def test_an_empty_reply_reaches_the_agent_as_the_empty_string_it_trains_as(server, tmp_path):
    """A completion with no text and no tool call: the agent gets content "" (as OpenAI returns an
    empty text completion), not None, and the tokens trained for that call decode to the same "";
    the agent sends it back as the assistant turn and its next call extends the conversation."""
    seen = Seen(tmp_path)

    def agent(row, client, **kwargs):
        messages = [{"role": "user", "content": row["prompt"]}]
        replies = []
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages)
            replies.append(reply.choices[0].message.content)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "again"},
            ]
        seen["replies"] = replies
        return 1.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(agent, concurrency=1, timeout_s=10.0)
    session = AgentRolloutSession(server, EmptyFirstReply(), EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 10.0)
    try:
        (result,) = session.run(agent_rows(1))
    finally:
        runner.close()
    assert result.outcome.error is None, result.outcome
    (seq,) = result.record.sequences
    spans, span = [], []
    for t, m in zip(seq.response_ids, seq.loss_mask):
        if m:
            span.append(t)
        elif span:
            spans.append(span)
            span = []
    spans.append(span)
    trained = [EchoTokenizer().decode(s) for s in spans]
    assert seen["replies"] == trained == ["", "2"]
    assert result.record.counts.unmerged_calls == 0


def _three_calls(stream: bool):
    """`three_calls_with_a_tool`, with the first and the last call streamed (the usage asked for
    in the last) when `stream`."""

    def agent(row, client, **kwargs):
        messages = [{"role": "user", "content": row["prompt"]}]
        for k in range(3):
            if stream and k != 1:
                chunks = list(
                    client.chat.completions.create(
                        model="policy", messages=messages, stream=True, stream_options={"include_usage": k == 2}
                    )
                )
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = [c.usage for c in chunks if c.usage]
                if k == 2 and (len(usage) != 1 or usage[0].completion_tokens != len(content) + 1):  # (+ EOS)
                    raise AssertionError(f"usage {usage} for {content!r}")
            else:
                content = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": f"tool saw {content}"}]
        return {"score": float(row["ground_truth"]), "calls": 3}

    return agent


def test_a_streamed_call_is_recorded_token_for_token_as_a_plain_one(server):
    """stream=true (OpenAI's server-sent events, through the `openai` client): the agent reads the
    same replies, and the trajectory trains on the same tokens, log-probs and mask as without."""
    records = []
    for stream in (False, True):
        session, _ = make_session(_three_calls(stream), server)
        (result,) = session.run(agent_rows(1))
        assert result.outcome.error is None and result.record.counts.calls == 3
        (seq,) = result.record.sequences
        records.append((seq.prompt_ids, seq.response_ids, seq.logprobs, seq.loss_mask))
    assert records[0] == records[1]


def test_the_responses_api_chains_and_streams_onto_one_recorded_conversation(server, tmp_path):
    """An agent on the Responses API: instructions, a function tool, a call whose output goes back
    with previous_response_id, a streamed third call. All three land in one sequence, as the same
    conversation through chat completions would; another trajectory's response id is not found."""
    seen = Seen(tmp_path)
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}

    def responses_agent(row, client, **kwargs):
        first = client.responses.create(model="policy", instructions="be brief", input=row["prompt"], tools=[tool])
        second = client.responses.create(
            model="policy",
            instructions="be brief",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": "call_1", "output": "42"}],
            tools=[tool],
        )
        with client.responses.stream(
            model="policy", instructions="be brief", previous_response_id=second.id, input="again"
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            third = stream.get_final_response()
        seen[f"texts{row['prompt']}"] = [first.output_text, second.output_text, third.output_text, "".join(deltas)]
        seen[f"id{row['prompt']}"] = first.id
        if row["prompt"] == "q1":  # the other trajectory's response, once it has one
            other = seen.wait_for("idq0")
            try:
                client.responses.create(model="policy", previous_response_id=other, input="x")
                seen["foreign"] = 200
            except openai.NotFoundError as e:
                seen["foreign"] = e.status_code
        return 1.0

    session, gen = make_session(responses_agent, server)
    results = session.run(agent_rows(2))
    assert seen.get("textsq0") is not None, [r.outcome for r in results]
    assert seen["foreign"] == 404
    for r in results:
        (seq,) = r.record.sequences  # chained calls extend one conversation
        assert r.record.counts.calls == 3 and r.record.counts.unmerged_calls == 0
        text = "".join(chr(t) for t in seq.prompt_ids + seq.response_ids)
        assert text.startswith("s:be brief|u:q")  # the instructions as the system message
        assert "t:42|" in text and text.count("s:be brief|") == 1  # the tool's output, the instructions once
    texts = seen["textsq0"]
    assert texts[2] == texts[3] and all(texts[:3])


def test_env_sampling_run_replaces_a_call_s_settings_and_counts(server):
    def two_hot_calls(row, client, **kwargs):
        for _ in range(2):
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}], temperature=0.5, top_p=0.8
            )
        return 1.0

    limits = AgentLimits(max_prompt_tokens=40, max_response_tokens=400, max_tokens_per_call=8, max_calls=8)
    runner = AgentRunner(two_hot_calls, concurrency=2, timeout_s=30.0)
    gen = ScriptedGenerator()
    session = AgentRolloutSession(server, gen, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 30.0, sampling="run")
    (result,) = session.run(agent_rows(1))
    assert result.outcome.error is None and result.record.counts.sampling_overridden == 2
    assert all(s.temperature is None and s.top_p == 1.0 for s in gen.sampling)  # the run's
    assert all(t == 0.0 for s in result.record.sequences for t in s.temperatures)
    assert all(m == 1 for s in result.record.sequences for m in s.loss_mask)  # trained, at the run's settings


def test_unstored_responses_are_not_found_and_a_new_rollout_drops_the_stored_ones(server, tmp_path):
    """store=false keeps nothing to chain on; a response of the last rollout is not found in the
    next (its keys, and the conversations stored under its responses, are gone). The agent's process
    has the Agents SDK's trace upload off."""
    seen = Seen(tmp_path)

    def agent(row, client, **kwargs):
        import os

        seen[f"tracing{row['prompt']}"] = os.environ.get("OPENAI_AGENTS_DISABLE_TRACING")
        kept = client.responses.create(model="policy", input="q")
        unkept = client.responses.create(model="policy", input="q", store=False)
        try:
            client.responses.create(model="policy", previous_response_id=unkept.id, input="x")
            seen[f"unkept{row['prompt']}"] = 200
        except openai.NotFoundError as e:
            seen[f"unkept{row['prompt']}"] = e.status_code
        last = seen.get("kept")
        if last is not None:  # the first rollout's response, in the second
            try:
                client.responses.create(model="policy", previous_response_id=last, input="x")
                seen["stale"] = 200
            except openai.NotFoundError as e:
                seen["stale"] = e.status_code
        seen["kept"] = kept.id
        return 1.0

    session, _ = make_session(agent, server)
    session.run(agent_rows(1))
    assert seen["unkeptq0"] == 404 and seen["tracingq0"] == "1"
    session, _ = make_session(agent, server)
    session.run(agent_rows(1))
    assert seen.get("stale") == 404
