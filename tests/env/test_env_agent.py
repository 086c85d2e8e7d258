"""`env=agent` without an engine: the token record, the wire format, the agent runner, and a whole
rollout session over real HTTP with the `openai` client (a scripted generator stands in for vLLM;
tests/env/test_env_integration.py runs the same on a real engine and in whole runs)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import openai
import pytest

from rlhf_orch.engines.agent_rollout import AgentRolloutSession, CallOutput, trajectory_completions
from rlhf_orch.env.agent_driver.chat_server import ChatServer
from rlhf_orch.env.agent import AgentEnv, agent_row
from rlhf_orch.env.agent_driver.record import AgentLimits, AgentRecord, CallRefused
from rlhf_orch.env.agent_driver.runner import AgentHostError, AgentRunner, accepted_keywords, reward_of
from rlhf_orch.env.base import EnvError
from rlhf_orch.env.agent_driver.chat_api import ChatAPIError, parse_request, parse_tool_calls
from rlhf_orch.data.base import Prompt
from rlhf_orch.transfer.plan import extra_sequence_index


class Seen:
    """What agent functions report to the test: they run in processes of their own (the runner's
    host forks one per trajectory), so a dict in the test would stay empty. One JSON file per key."""

    def __init__(self, directory):
        self.directory = str(directory)

    def __setitem__(self, key, value) -> None:
        path = os.path.join(self.directory, f"{key}.json")
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(value, f)
        os.replace(f"{path}.{os.getpid()}", path)  # a reader never sees half a value

    def __getitem__(self, key):
        try:
            with open(os.path.join(self.directory, f"{key}.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise KeyError(key) from None

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def wait_for(self, key, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while (value := self.get(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} reported")
            time.sleep(0.02)
        return value

LIMITS = AgentLimits(max_prompt_tokens=8, max_response_tokens=20, max_tokens_per_call=5, max_calls=4)


# --------------------------------------------------------------------------- the record
def test_calls_that_extend_a_conversation_merge_into_one_masked_sequence():
    r = AgentRecord(0, LIMITS)
    r.add([1, 2, 3], [10, 11, 2], [-0.1, -0.2, -0.3], hit_length=False)
    # the agent appended a tool message (tokens 7 8): context, then the model's second answer
    r.add([1, 2, 3, 10, 11, 2, 7, 8], [12, 2], [-0.4, -0.5], hit_length=False)
    (seq,) = r.sequences
    assert seq.prompt_ids == [1, 2, 3]
    assert seq.response_ids == [10, 11, 2, 7, 8, 12, 2]
    assert seq.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert seq.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert (r.counts.calls, r.counts.unmerged_calls, r.counts.observation_tokens, r.counts.completion_tokens) == (2, 0, 2, 5)


def test_a_call_that_rewrites_history_starts_a_sequence_and_is_counted():
    r = AgentRecord(0, LIMITS)
    r.add([1, 2, 3], [10, 2], [-0.1, -0.2], hit_length=False)
    r.add([1, 2, 3, 99, 2, 7], [12], [-0.4], hit_length=True)  # the model's answer edited: 99 for 10
    assert len(r.sequences) == 2 and r.counts.unmerged_calls == 1
    # both train; the one with most of the model's tokens first (the first begun on a tie)
    assert r.trained_sequences([1], eos_id=2) == [r.sequences[0], r.sequences[1]]
    r.add([5, 6], [7, 8, 9], [-0.1] * 3, hit_length=False)  # a second conversation, longer
    assert r.trained_sequences([1], eos_id=2) == [r.sequences[2], r.sequences[0], r.sequences[1]]


def test_the_budget_caps_max_tokens_and_refuses_what_cannot_fit():
    r = AgentRecord(0, LIMITS)
    assert r.budget([1, 2, 3], None) == 5  # env.max_tokens_per_turn
    assert r.budget([1, 2, 3], 2) == 2  # what the agent asked for, when smaller
    with pytest.raises(CallRefused, match="data.prompt_max_len"):
        r.budget(list(range(9)), None)
    r.add([1, 2, 3], [4] * 5, [0.0] * 5, hit_length=True)
    context = [1, 2, 3] + [4] * 5 + [9] * 12  # 17 of 20 response tokens used
    assert r.budget(context, None) == 3
    with pytest.raises(CallRefused, match="data.response_max_len"):
        r.budget(context + [9, 9, 9], None)
    for _ in range(3):
        r.add([5], [6], [0.0], hit_length=False)
    with pytest.raises(CallRefused, match="env.max_calls"):
        r.budget([1, 2, 3], None)


def test_an_agent_that_made_no_call_trains_nothing():
    (seq,) = AgentRecord(0, LIMITS).trained_sequences([1, 2], eos_id=2)
    assert seq.prompt_ids == [1, 2] and seq.response_ids == [2] and seq.loss_mask == [0]


# --------------------------------------------------------------------------- the wire format
def _body(**kw):
    return {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body, status, param", [
    (_body(model="gpt-4o"), 404, "model"),
    (_body(n=2), 400, "n"),
    (_body(logprobs=False), 400, "logprobs"),
    (_body(temperature=0.7), 400, "temperature"),
    (_body(top_p=0.9), 400, "top_p"),
    (_body(stream=True), 400, "stream"),
    (_body(messages=[]), 400, "messages"),
    (_body(max_tokens=0), 400, "max_tokens"),
    (_body(best_of=3), 400, "best_of"),
])
def test_parameters_that_would_break_training_are_refused_with_a_message(body, status, param):
    with pytest.raises(ChatAPIError) as e:
        parse_request(body, "policy", temperature=1.0)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body()["error"]["message"]


def test_what_training_can_use_is_accepted():
    call = parse_request(_body(temperature=1.0, max_completion_tokens=7, stop="\n", tools=[{"type": "function"}], seed=3,
                               messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                         {"role": "assistant", "content": None, "tool_calls": [
                                             {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}]),
                         "policy", temperature=1.0)
    assert call.max_tokens == 7 and call.stop == ["\n"] and call.messages[0]["content"] == "ab"
    assert call.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # as chat templates read it


def test_hermes_tool_calls_become_openai_tool_calls():
    content, calls = parse_tool_calls('Let me look. <tool_call>{"name": "lookup", "arguments": {"record": "3 1"}}</tool_call>', "hermes")
    assert content == "Let me look."
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"record": "3 1"}'} and calls[0]["type"] == "function"
    assert parse_tool_calls("<tool_call>not json</tool_call>", "hermes") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', "none")[1] == []


# --------------------------------------------------------------------------- the runner
def test_rewards_and_keywords():
    assert reward_of(0.5) == (0.5, {})
    assert reward_of({"score": 1, "calls": 3, "note": "x"}) == (1.0, {"calls": 3.0})
    for bad in ("1", None, {"reward": 1}, float("nan"), True):
        with pytest.raises(TypeError):
            reward_of(bad)
    assert accepted_keywords(lambda row, **kw: 0) == ("client", "base_url", "api_key")
    assert accepted_keywords(lambda row, base_url, api_key=None: 0) == ("base_url", "api_key")


def test_agent_option_refuses_what_it_cannot_call(tmp_path):
    f = tmp_path / "agents.py"
    f.write_text("class NotAFunction:\n    pass\n\ndef no_row(*, client):\n    return 0\n\nbroken = 1\n")
    for name, match in (("missing", "defines no"), ("NotAFunction", "not a function"), ("no_row", "no positional")):
        with pytest.raises(EnvError, match=match):
            AgentEnv(path=str(f), name=name).load()
    with pytest.raises(EnvError, match="env.path"):
        AgentEnv(path=str(tmp_path / "nope.py"), name="x").load()
    with pytest.raises(EnvError, match="env.tool_parser"):
        AgentEnv(path=str(f), name="x", tool_parser="xml")


def test_agent_option_refuses_a_function_that_cannot_reach_its_process(tmp_path):
    """Before Ray: a function holding what cannot be pickled (a module-level lock) is refused in
    the config check, naming the file, not at the first rollout on an engine."""
    f = tmp_path / "locked.py"
    f.write_text("import threading\nLOCK = threading.Lock()\n\ndef agent(row, client):\n    with LOCK:\n        return 0.0\n")
    env = AgentEnv(path=str(f), name="agent")
    with pytest.raises(EnvError, match="locked.py cannot be sent to the process agents run in"):
        env.check(Prompt(text="q", label="1"), None)
    (tmp_path / "fine.py").write_text("def agent(row, client):\n    return 0.0\n")
    AgentEnv(path=str(tmp_path / "fine.py"), name="agent").check(Prompt(text="q", label="1"), None)


# --------------------------------------------------------------------------- a whole session over HTTP
class EchoTokenizer:
    """Token ids are characters' code points (0 is EOS); the chat template writes `r:content|` per
    message, an assistant's as `a:content<EOS>`, and `a:` as the generation prompt."""

    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        text = "".join(f"a:{m.get('content') or ''}\x00" if m["role"] == "assistant" else f"{m['role'][0]}:{m.get('content') or ''}|"
                       for m in messages)
        return [ord(c) for c in text + ("a:" if add_generation_prompt else "")]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


class ScriptedGenerator:
    """Answers each call with the digits of its call number, one per token, then EOS."""

    def __init__(self):
        self.pending, self.submitted, self.aborted = [], [], []

    def submit(self, key, prompt_ids, max_tokens, seed, stop):
        self.submitted.append((key, list(prompt_ids), max_tokens, seed))
        ids = [ord(c) for c in str(len(self.submitted))][: max_tokens - 1] + [0]
        self.pending.append(CallOutput(key, ids, [-0.5] * len(ids), "stop"))

    def busy(self):
        return bool(self.pending)

    def poll(self):
        out, self.pending = self.pending, []
        return out

    def abort(self, keys):
        self.aborted.extend(keys)


def _session(fn, server, timeout_s=10.0):
    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(fn, concurrency=4, timeout_s=timeout_s)
    gen = ScriptedGenerator()
    return AgentRolloutSession(server, gen, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", timeout_s), gen


def three_calls_with_a_tool(row, client, **kwargs):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "tool", "content": f"tool saw {reply.choices[0].message.content}"}]
    return {"score": float(row["ground_truth"]), "calls": 3}


@pytest.fixture
def server():
    s = ChatServer("127.0.0.1", "policy")
    yield s
    s.close()


def _rows(n):
    return [(i, agent_row(Prompt(text=f"q{i}", label=str(i / 10)))) for i in range(n)]


def test_a_session_records_every_call_of_every_trajectory_as_one_sequence(server):
    session, gen = _session(three_calls_with_a_tool, server)
    results = session.run(_rows(3))
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

    session, _ = _session(agent, server, timeout_s=1.0)
    t = time.perf_counter()
    results = {r.index: r for r in session.run(_rows(3))}
    assert time.perf_counter() - t < 10
    assert results[0].outcome.reward == 1.0
    assert results[1].outcome.error == "RuntimeError: the agent's bug" and results[1].outcome.reward == 0.0
    assert results[2].outcome.timed_out and results[2].outcome.reward == 0.0
    # the two that made no model call train nothing and leave their group's statistics (masked)
    stats = {i: f["stats"] for i, f in trajectory_completions(list(results.values()), {i: [1] for i in range(3)}, eos_id=0)}
    assert [stats[i]["masked"] for i in range(3)] == [0.0, 1.0, 1.0]


def test_bad_requests_get_http_errors_and_the_server_leaves_no_listener(server, tmp_path):
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        def error(**kw):
            try:
                client.chat.completions.create(**{"model": "policy", "messages": [{"role": "user", "content": "x"}], **kw})
            except openai.APIStatusError as e:
                return e.status_code, e.message
            return 200, ""

        seen["n=2"] = error(n=2)
        seen["model"] = error(model="another-model")
        seen["key"] = None
        try:
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        except openai.AuthenticationError as e:
            seen["key"] = (e.status_code, e.message)
        seen["models"] = [m.id for m in client.models.list()]
        seen["url"], seen["api_key"] = base_url, api_key
        return 0.0

    session, _ = _session(agent, server)
    session.run(_rows(1))
    assert seen["n=2"][0] == 400 and "n=2" in seen["n=2"][1]
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
    session, _ = _session(answer_then_check_in_a_new_conversation, server)
    results = session.run(_rows(3))
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


def test_a_trajectory_s_further_sequences_share_its_advantage_and_count_once():
    """GRPO over 2 prompts x 2 trajectories, trajectory 1 with two further sequences: the group's
    mean and spread are over its trajectories (not weighted by sequences), every further sequence
    takes its trajectory's advantage, and the metrics' rewards are the trajectories'."""
    from hydra.utils import instantiate

    from rlhf_orch.orchestration.loop import sample_values_by_index
    from rlhf_orch.transfer.engine_side import RolloutMeta
    from tests.conftest import compose_config

    extras = [extra_sequence_index(1, 1), extra_sequence_index(1, 2)]
    meta = RolloutMeta(indices=[0, 1, 2, 3, *extras], seq_lens=[5] * 6, response_lens=[3] * 6,
                       rewards=[0.0, 1.0, 0.5, 0.5, 0.7, 0.2], truncated=[False] * 6, weight_versions=[0] * 6)
    meta.share_trajectory_rewards()  # a reward model scored the further sequences alone
    assert meta.rewards == [0.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert meta.trajectories_only().indices == [0, 1, 2, 3]
    algo = instantiate(compose_config(["algo=grpo", "algo.samples_per_prompt=2"]).algo)
    values, _ = sample_values_by_index(algo, meta, samples_per_prompt=2, response_max_len=8)
    assert values[1] > 0 > values[0] and values[1] == pytest.approx(-values[0])  # a group of two, not four
    assert values[extras[0]] == values[extras[1]] == values[1]
    assert values[2] == values[3] == 0.0


def test_the_endpoint_reads_tool_calls_with_vllm_s_parsers(smollm2_tokenizer):
    """env.tool_parser=llama3_json (any vLLM tool parser): the completion's tool_calls as vLLM's own
    OpenAI server would return them; an unknown name is refused before Ray."""
    import copy

    from rlhf_orch.env.base import EnvError
    from rlhf_orch.env.tool_parsers import check_tool_parser

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"record": {"type": "string"}}}}}]
    content, calls = parse_tool_calls('{"name": "lookup", "parameters": {"record": "3 1"}}', "llama3_json", tok, tools)
    assert [c["function"]["name"] for c in calls] == ["lookup"] and json.loads(calls[0]["function"]["arguments"]) == {"record": "3 1"}
    assert parse_tool_calls("just words", "llama3_json", tok, tools) == ("just words", [])
    with pytest.raises(EnvError, match="env.tool_parser='hermes2'"):
        check_tool_parser("env.tool_parser", "hermes2", ("hermes", "none"))


def test_the_endpoint_separates_reasoning_with_vllm_s_parsers(smollm2_tokenizer):
    """env.reasoning_parser=qwen3: <think>...</think> becomes the message's reasoning_content and the
    tool calls are read from the rest."""
    import copy

    from rlhf_orch.env.agent_driver.chat_api import completion_body

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    text = '<think>The record is 3 1.</think>Looking it up. <tool_call>{"name": "lookup", "arguments": {"record": "3 1"}}</tool_call>'
    message = completion_body("policy", text, "stop", 5, 9, "hermes", tok, None, "qwen3")["choices"][0]["message"]
    assert message["reasoning_content"] == "The record is 3 1." and message["content"] == "Looking it up."
    assert message["tool_calls"][0]["function"]["name"] == "lookup"
    assert "reasoning_content" not in completion_body("policy", text, "stop", 5, 9, "hermes", tok)["choices"][0]["message"]


class SlowGenerator(ScriptedGenerator):
    """Answers each call `hold_s` after it arrived: calls made at once are all in flight together
    (what an agent fanning out with `asyncio.gather` does to the engine)."""

    def __init__(self, hold_s: float):
        super().__init__()
        self.hold_s, self.due = hold_s, []

    def submit(self, key, prompt_ids, max_tokens, seed, stop):
        super().submit(key, prompt_ids, max_tokens, seed, stop)
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
    (result,) = session.run(_rows(1))
    assert sorted(seen["replies"]) == ["answer"] * 4 + ["refused"] * 4, result.outcome
    assert len(gen.submitted) == 4 and result.record.counts.calls == 4 and result.record.counts.refused_calls == 4


def test_a_conversation_takes_one_call_at_a_time(server, tmp_path):
    """Two calls at once that both extend one conversation: the second is refused (recorded after
    the first, its prompt would no longer extend the conversation and would start a sequence past
    data.prompt_max_len); calls on other conversations go on."""
    seen = Seen(tmp_path)

    async def two_at_once(row, client, **kwargs):
        history = [{"role": "user", "content": "q" * 30}]
        first = await client.chat.completions.create(model="policy", messages=history)
        history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "tool", "content": "t"}]

        async def extend(tag):
            try:
                await client.chat.completions.create(model="policy", messages=[*history, {"role": "user", "content": tag}])
                return "answer"
            except openai.BadRequestError as e:
                assert "still being answered" in str(e) and e.body["type"] == "conversation_busy"
                return "refused"

        seen["extensions"] = sorted(await asyncio.gather(extend("a"), extend("b")))
        return 1.0

    limits = AgentLimits(max_prompt_tokens=40, max_response_tokens=400, max_tokens_per_call=8, max_calls=8)
    session, gen = _fan_out_session(server, two_at_once, limits)
    (result,) = session.run(_rows(1))
    assert seen.get("extensions") == ["answer", "refused"], result.outcome
    (seq,) = result.record.sequences  # one conversation, nothing past data.prompt_max_len
    assert len(seq.prompt_ids) <= 40 and result.record.counts.calls == 2 and result.record.counts.unmerged_calls == 0


def _raw(server, request: bytes, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Send raw bytes; (what came back before the server closed or went quiet, closed by the server)."""
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except socket.timeout:
            return got, False
        return got, True


def test_the_endpoint_checks_the_key_and_the_length_before_it_reads_a_body(server):
    """Answered at once and the connection closed, the body never read: a request without the key
    (however large it says its body is), a Content-Length that is not a number, a body over
    MAX_BODY_BYTES. Only then an authorised request's body is read."""
    from rlhf_orch.env.agent_driver.chat_server import MAX_BODY_BYTES

    path = "/trajectories/abc/v1/chat/completions"
    no_key, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES}\r\n\r\n".encode())
    assert no_key.startswith(b"HTTP/1.1 401") and closed  # its 16 MiB never sent: not waited for
    key = f"Authorization: Bearer {server.issue_keys(['abc'])['abc']}\r\n"  # (what a rollout hands trajectory abc)
    bad_length, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: ten\r\n\r\n".encode())
    assert bad_length.startswith(b"HTTP/1.1 400") and b"not a number" in bad_length and closed
    too_big, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
    assert too_big.startswith(b"HTTP/1.1 413") and closed
    # a refusal with part of a body already sent: answered, then closed (the server drains what came,
    # since a close with unread bytes may reset the connection; on loopback here the answer arrives
    # either way, so this does not show the drain is needed)
    partial, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 50000)
    assert partial.startswith(b"HTTP/1.1 401") and closed
    superscript, _ = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: \u00b2\r\n\r\n".encode("latin-1"))
    assert superscript.startswith(b"HTTP/1.1 400")
    chunked, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".encode())
    assert chunked.startswith(b"HTTP/1.1 411") and closed
    # with the key and a body: read, and answered on a connection that stays open (keep-alive)
    body = b'{"model": "policy", "messages": []}'
    ok, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: {len(body)}\r\n\r\n".encode() + body, timeout_s=2.0)
    assert ok.startswith(b"HTTP/1.1 410") and not closed  # no rollout runs: gone, the connection kept


def test_the_endpoint_refuses_connections_past_its_limit():
    server = ChatServer("127.0.0.1", "policy", max_connections=2)
    try:
        held = [socket.create_connection((server.host, server.port), timeout=5) for _ in range(2)]
        time.sleep(0.3)  # both accepted, each holding its thread
        refused, closed = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503") and b"more than 2 connections" in refused and closed
        for sock in held:
            sock.close()
        time.sleep(0.3)  # their threads end and give their places back
        key = server.issue_keys(["t"])["t"]
        again, _ = _raw(server, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode(), timeout_s=2.0)
        assert again.startswith(b"HTTP/1.1 200")
    finally:
        server.close()


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
        results = {r.index: r for r in session.run(_rows(2))}
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

    session, _ = _session(agent, server)
    try:
        for _ in range(2):
            results = {r.index: r.outcome for r in session.run(_rows(3))}
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
        with pytest.raises(AgentHostError, match="could not be loaded in its process: RuntimeError: this function cannot be loaded here"):
            runner.wait(10)
    finally:
        runner.close()


def test_a_host_that_dies_fails_its_rollout_and_the_next_rollout_starts_another(tmp_path):
    def agent(row, **kwargs):
        time.sleep(row["sleep"])
        return 1.0

    runner = AgentRunner(agent, concurrency=2, timeout_s=20.0)
    try:
        runner.start([(0, {"sleep": 30}, "http://127.0.0.1:9/v1", "k"), (1, {"sleep": 30}, "http://127.0.0.1:9/v1", "k")])
        time.sleep(0.3)
        os.kill(runner._host.pid, 9)
        runner._host.wait()  # (dead before the next start looks at it)
        assert runner.wait(10)
        assert all("host process ended" in runner.outcomes[i].error for i in (0, 1))
        runner.start([(0, {"sleep": 0}, "http://127.0.0.1:9/v1", "k")])
        assert runner.wait(20) and runner.outcomes[0].reward == 1.0, runner.outcomes
    finally:
        runner.close()


def test_the_engine_steps_an_agent_session_makes_count_for_the_engines_liveness(monkeypatch):
    """An agent session steps vLLM itself (no shared stepping): each step counts, so the driver's
    `progress` question sees a busy engine move while `ping` waits behind the session."""
    from types import SimpleNamespace

    from rlhf_orch.engines import agent_rollout
    from rlhf_orch.engines.request_steps import VLLMCalls
    from rlhf_orch.engines.vllm_engine import VLLMEngine
    from rlhf_orch.liveness import WorkCount

    vllm_engine = SimpleNamespace(step=lambda: [SimpleNamespace(finished=False)], has_unfinished_requests=lambda: True)
    counted: list[int] = []
    calls = VLLMCalls(SimpleNamespace(llm_engine=vllm_engine), 1.0, count_step=lambda: counted.append(1))
    for _ in range(3):
        assert calls.poll() == []
    assert len(counted) == 3
    # The engine hands the session its own count, the one `progress` answers.
    engine = object.__new__(VLLMEngine)  # no vLLM: only what an agent rollout's start needs
    engine.samples_scored = WorkCount()
    engine.llm, engine.steps_made, engine._chat_server, engine._agent_runner = None, 0, lambda env: None, lambda env: None
    handed = {}
    monkeypatch.setattr(agent_rollout, "complete_agent_trajectories", lambda *args: handed.setdefault("count_step", args[-1]))
    engine._complete_agents([], SimpleNamespace(env=None), step_seed=0)
    handed["count_step"]()
    handed["count_step"]()
    assert engine.progress() == 2


def test_each_trajectory_has_its_own_key_and_cannot_call_as_another(server, tmp_path):
    """Two trajectories of one rollout: each agent's key works for its own base URL (and the model
    list), not for the other's -- an agent cannot spend another's call budget or read its
    conversation -- and no key of a rollout works once the next rollout has its keys."""
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        index = int(row["prompt"][1:])
        seen[index] = (base_url, api_key)
        other_url, _ = seen.wait_for(1 - index)  # both trajectories are live
        try:
            openai.OpenAI(base_url=other_url, api_key=api_key, max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}])
            seen[10 + index] = ("called as the other", "")
        except openai.AuthenticationError as e:
            seen[10 + index] = ("refused", str(e.status_code))
        assert [m.id for m in client.models.list()] == ["policy"]
        root = base_url.split("/trajectories/")[0] + "/v1"  # the model list outside any trajectory: any live key
        assert [m.id for m in openai.OpenAI(base_url=root, api_key=api_key, max_retries=0).models.list()] == ["policy"]
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1.0 if reply.choices[0].message.content else 0.0

    session, _ = _session(agent, server)
    results = session.run(_rows(2))
    assert seen[10] == seen[11] == ["refused", "401"]
    assert seen[0][1] != seen[1][1]
    assert all(r.outcome.reward == 1.0 for r in results)
    server.issue_keys(["next"])  # the next rollout
    late = openai.OpenAI(base_url=seen[0][0], api_key=seen[0][1], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        late.models.list()


def _key_shaped_strings_in_own_memory() -> tuple[int, set[bytes]]:
    """(regions read, what was found): every readable region of this process's memory
    (/proc/self/maps, /proc/self/mem), its environment and command line included (they sit on its
    stack), searched for anything shaped like a trajectory's key (`rlhf-` and 32 URL-safe
    characters) or base URL (`/trajectories/<16 hex>/`). For agents (it runs in their processes)."""
    import re

    # (two patterns with a literal prefix each: searched ~5x faster than one with both)
    patterns = [re.compile(rb"rlhf-[A-Za-z0-9_-]{32}"), re.compile(rb"/trajectories/[0-9a-f]{16}/")]
    found: set[bytes] = set()
    chunk, overlap = 1 << 24, 64
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        regions = [line.split() for line in maps]
        for fields in regions:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not fields[1].startswith("r") or fields[-1] in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
                continue
            for at in range(start, end, chunk):
                try:
                    mem.seek(at)
                    data = mem.read(min(chunk + overlap, end - at))
                except (OSError, ValueError, OverflowError):
                    break
                for pattern in patterns:
                    found.update(pattern.findall(data))
    return len(regions), found


def test_an_agent_s_process_holds_its_own_key_and_no_other_trajectory_s(server, tmp_path):
    """16 trajectories, 4 at a time: each agent reads all of its own process's memory and finds its
    own key and base URL there, and no other trajectory's of the batch (with the batch's list
    forked into every process, the first agent found all 16 of each)."""
    issued: dict[str, str] = {}
    issue_keys = server.issue_keys

    def recording(ids):
        issued.update(keys := issue_keys(ids))
        return keys

    server.issue_keys = recording
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        regions, found = _key_shaped_strings_in_own_memory()
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        seen[row["prompt"]] = {
            "key": api_key, "url": base_url, "regions": regions,
            "keys": sorted(f.decode() for f in found if f.startswith(b"rlhf-")),
            "urls": sorted(f.decode() for f in found if f.startswith(b"/trajectories/")),
        }
        return 1.0 if reply.choices[0].message.content else 0.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(agent, concurrency=4, timeout_s=60.0)
    session = AgentRolloutSession(server, ScriptedGenerator(), EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 60.0)
    try:
        results = session.run(_rows(16))
    finally:
        runner.close()
    assert all(r.outcome.reward == 1.0 for r in results), [r.outcome for r in results]
    assert len(issued) == 16
    urls = {server.base_url(t) for t in issued}
    for i in range(16):
        report = seen[f"q{i}"]
        assert report["key"] in issued.values() and report["url"] in urls
        assert report["keys"] == [report["key"]], f"trajectory {i} holds {len(report['keys']) - 1} other trajectories' keys"
        own_path = report["url"][report["url"].index("/trajectories/"):-len("v1")]
        assert report["urls"] == [own_path], f"trajectory {i} holds {len(report['urls']) - 1} other trajectories' URLs"


def test_agents_reach_the_endpoint_past_a_proxy_set_in_the_environment(server, tmp_path, monkeypatch):
    """HTTP(S)_PROXY and ALL_PROXY name a dead proxy (a cluster's job environment often sets one):
    the client handed to the agent, a client the agent builds from `base_url` (`openai`, httpx's
    default: proxies from the environment) and the standard library's urllib all still reach the
    engine's loopback endpoint, not the proxy."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
        monkeypatch.setenv(name.lower(), dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        import urllib.request

        def reached(call):
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - reported to the test
                return f"{type(e).__name__}: {e}"

        request = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
        own = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        plain = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"})
        seen[row["prompt"]] = {
            "given": reached(lambda: client.chat.completions.create(**request).choices[0].message.content),
            "own": reached(lambda: own.chat.completions.create(**request).choices[0].message.content),
            "urllib": reached(lambda: json.load(urllib.request.urlopen(plain, timeout=5))["data"][0]["id"]),
        }
        return 1.0

    session, _ = _session(agent, server)
    try:
        session.run(_rows(1))
    finally:
        session.runner.close()
    assert seen["q0"] == {"given": "1", "own": "2", "urllib": "policy"}


class EmptyFirstReply(ScriptedGenerator):
    """The first call's completion is the end-of-turn token alone (an empty reply); later calls as
    ScriptedGenerator's."""

    def submit(self, key, prompt_ids, max_tokens, seed, stop):
        super().submit(key, prompt_ids, max_tokens, seed, stop)
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
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "again"}]
        seen["replies"] = replies
        return 1.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(agent, concurrency=1, timeout_s=10.0)
    session = AgentRolloutSession(server, EmptyFirstReply(), EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 10.0)
    try:
        (result,) = session.run(_rows(1))
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


def test_content_is_empty_text_without_tool_calls_and_null_beside_them():
    from rlhf_orch.env.agent_driver.chat_api import completion_body

    def message(text):
        return completion_body("policy", text, "stop", 3, 1, "hermes")["choices"][0]["message"]

    assert message("")["content"] == "" and "tool_calls" not in message("")
    call_only = message('<tool_call>{"name": "lookup", "arguments": {"record": "3"}}</tool_call>')
    assert call_only["content"] is None and call_only["tool_calls"][0]["function"]["name"] == "lookup"
    assert message("hi")["content"] == "hi"
