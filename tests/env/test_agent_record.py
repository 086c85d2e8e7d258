"""`env=agent` without an engine: the token record, the wire format (the endpoint's requests and
replies, vLLM's tool-call and reasoning parsers) and the agent option's checks."""

from __future__ import annotations

import json

import pytest

from rlhf_orch.env.agent import AgentEnv
from rlhf_orch.env.agent_driver.record import AgentLimits, AgentRecord, CallRefused
from rlhf_orch.env.agent_driver.runner import accepted_keywords, reward_of
from rlhf_orch.env.base import EnvError
from rlhf_orch.env.agent_driver.chat_api import CallSampling, ChatAPIError, parse_request, parse_tool_calls
from rlhf_orch.data.base import Prompt
from rlhf_orch.transfer.plan import extra_sequence_index

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
    assert (r.counts.calls, r.counts.unmerged_calls, r.counts.observation_tokens, r.counts.completion_tokens) == (
        2,
        0,
        2,
        5,
    )


def test_a_call_that_rewrites_history_branches_from_the_last_boundary_it_shares():
    r = AgentRecord(0, LIMITS)
    r.add([1, 2, 3], [10, 2], [-0.1, -0.2], hit_length=False)
    r.add([1, 2, 3, 99, 2, 7], [12], [-0.4], hit_length=True)  # the model's answer edited: 99 for 10
    first, edited = r.sequences
    assert (r.counts.branches, r.counts.unmerged_calls) == (1, 0)
    # the edited history is context of a branch from the prompt (not a prompt of its own)
    assert edited.prompt_ids == [1, 2, 3] and edited.response_ids == [99, 2, 7, 12] and edited.loss_mask == [0, 0, 0, 1]
    # both train; the one with most of the model's tokens first (the first begun on a tie)
    assert r.trained_sequences([1], eos_id=2) == [first, edited]
    r.add([5, 6], [7, 8, 9], [-0.1] * 3, hit_length=False)  # a second conversation, longer
    assert r.counts.unmerged_calls == 1
    assert r.trained_sequences([1], eos_id=2) == [r.sequences[2], first, edited]


def test_an_agent_going_back_to_an_earlier_answer_branches_there():
    limits = AgentLimits(max_prompt_tokens=3, max_response_tokens=30, max_tokens_per_call=5, max_calls=8)
    r = AgentRecord(0, limits)
    r.add([1, 2, 3], [10, 2], [-0.1, -0.2], hit_length=False)
    r.add([1, 2, 3, 10, 2, 7], [11, 2], [-0.3, -0.4], hit_length=False)
    r.add([1, 2, 3, 10, 2, 7, 11, 2, 8], [12, 2], [-0.5, -0.6], hit_length=False)
    # back to after the first answer, another tool result: longer than data.prompt_max_len, yet admitted
    back = [1, 2, 3, 10, 2, 9]
    assert r.budget(back, None) == 5
    r.add(back, [13, 2], [-0.7, -0.8], hit_length=False)
    trunk, branch = r.sequences
    assert branch.response_ids == [10, 2, 9, 13, 2] and branch.loss_mask == [1, 1, 0, 1, 1]
    assert branch.logprobs == [-0.1, -0.2, 0.0, -0.7, -0.8] and branch.calls == 2
    assert trunk.response_ids[-2:] == [12, 2] and (r.counts.branches, r.counts.unmerged_calls) == (1, 0)


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


@pytest.mark.parametrize(
    "body, status, param",
    [
        (_body(model="gpt-4o"), 404, "model"),
        (_body(n=0), 400, "n"),
        (_body(n=17), 400, "n"),
        (_body(n=True), 400, "n"),
        (_body(logprobs=False), 400, "logprobs"),
        (_body(temperature=2.5), 400, "temperature"),
        (_body(temperature="hot"), 400, "temperature"),
        (_body(top_p=0.0), 400, "top_p"),
        (_body(top_k=2.5), 400, "top_k"),
        (_body(top_k=-2), 400, "top_k"),
        (_body(presence_penalty=3), 400, "presence_penalty"),
        (_body(frequency_penalty=-2.5), 400, "frequency_penalty"),
        (_body(seed=1.5), 400, "seed"),
        (_body(seed=1e30), 400, "seed"),
        (_body(seed=2**70), 400, "seed"),
        (_body(seed=-1), 400, "seed"),
        (_body(seed=float("inf")), 400, "seed"),
        (_body(top_k=float("inf")), 400, "top_k"),
        (_body(temperature=float("nan")), 400, "temperature"),
        (_body(response_format={"type": "json_object"}), 400, "response_format"),
        (_body(logit_bias={"5": 3}), 400, "logit_bias"),
        (_body(min_p=0.1), 400, "min_p"),
        (_body(stream="yes"), 400, "stream"),
        (_body(stream_options={"include_usage": True}), 400, "stream_options"),  # (only with stream=true)
        (_body(messages=[]), 400, "messages"),
        (_body(max_tokens=0), 400, "max_tokens"),
        (_body(best_of=3), 400, "best_of"),
    ],
)
def test_parameters_that_would_break_training_are_refused_with_a_message(body, status, param):
    with pytest.raises(ChatAPIError) as e:
        parse_request(body, "policy")
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body()["error"]["message"]


def test_what_training_can_use_is_accepted():
    call = parse_request(
        _body(
            temperature=1.0,
            max_completion_tokens=7,
            stop="\n",
            tools=[{"type": "function"}],
            seed=3,
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
                },
            ],
        ),
        "policy",
    )
    assert call.max_tokens == 7 and call.stop == ["\n"] and call.messages[0]["content"] == "ab"
    assert call.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # as chat templates read it
    assert call.sampling == CallSampling(temperature=1.0, seed=3) and call.n == 1 and not call.overridden


def test_a_call_s_own_sampling_is_honoured_or_replaced_by_the_run_s():
    own = _body(temperature=0.7, top_p=0.9, top_k=-1, presence_penalty=0.5, frequency_penalty=-0.25, seed=11, n=3)
    call = parse_request(own, "policy", sampling="call")
    assert call.n == 3 and not call.overridden
    assert call.sampling == CallSampling(0.7, 0.9, 0, 0.5, -0.25, 11)  # top_k -1: off, as 0
    run = parse_request(own, "policy", sampling="run")
    assert run.sampling == CallSampling() and run.n == 3
    assert run.overridden == ["frequency_penalty", "presence_penalty", "seed", "temperature", "top_k", "top_p"]
    assert parse_request(_body(temperature=None), "policy", sampling="run").overridden == []


def test_concurrent_calls_on_one_conversation_and_n_completions_become_branches():
    limits = AgentLimits(max_prompt_tokens=8, max_response_tokens=30, max_tokens_per_call=5, max_calls=8)
    r = AgentRecord(0, limits)
    _, first = r.admit([1, 2], None)
    r.add([1, 2], [10, 3], [-0.1, -0.2], hit_length=False, branch=first)
    r.done(first)
    history = [1, 2, 10, 3, 7]  # the answer and a tool message
    _, a = r.admit(history, None)
    _, b = r.admit(history, None)  # the same history again, while `a` is answered: a fork
    r.add(history, [11, 3], [-0.3, -0.4], hit_length=False, temperature=0.5, branch=a)
    r.add(history, [12, 3], [-0.5, -0.6], hit_length=False, branch=b)
    r.done(a), r.done(b)
    trunk, fork = r.sequences
    assert trunk.response_ids == [10, 3, 7, 11, 3] and fork.response_ids == [10, 3, 7, 12, 3]
    assert fork.prompt_ids == trunk.prompt_ids == [1, 2]  # the same prompt: shared-prompt packing applies
    assert fork.loss_mask == trunk.loss_mask == [1, 1, 0, 1, 1]
    assert fork.logprobs == [-0.1, -0.2, 0.0, -0.5, -0.6]
    assert trunk.temperatures == [0.0, 0.0, 0.0, 0.5, 0.5] and fork.temperatures == [0.0] * 5
    assert (r.counts.branches, r.counts.unmerged_calls, r.counts.calls) == (1, 0, 3)
    # n = 3 on a new conversation: three sequences of one prompt, two of them branches
    _, n3 = r.admit([5, 6], 2, n=3)
    for k in range(3):
        r.add([5, 6], [20 + k], [-1.0], hit_length=False, branch=n3)
    r.done(n3)
    assert [s.response_ids for s in r.sequences[2:]] == [[20], [21], [22]]
    assert (r.counts.branches, r.counts.unmerged_calls, r.counts.calls) == (3, 1, 6)
    # every completion counts against env.max_calls, in flight too
    with pytest.raises(CallRefused, match="made 6 of its 8 calls"):
        r.admit([5, 6], None, n=3)
    _, two = r.admit([5, 6], None, n=2)
    with pytest.raises(CallRefused, match="env.max_calls"):
        r.admit([5, 6], None)


def test_a_temperature_vllm_samples_greedily_at_is_greedy():
    assert parse_request(_body(temperature=1e-7), "policy").sampling.temperature == 0.0
    assert parse_request(_body(temperature=1e-4), "policy").sampling.temperature == 1e-4
    assert parse_request(_body(response_format={"type": "text"}), "policy").n == 1


def test_truncated_sampling_trains_only_where_the_run_corrects_for_it():
    for corrected, mask in ((False, [0, 0]), (True, [1, 1])):
        r = AgentRecord(0, LIMITS, train_truncated_sampling=corrected)
        r.add([1, 2], [10, 3], [-0.1, -0.2], hit_length=False, truncated_sampling=True)
        assert r.sequences[0].loss_mask == mask and r.counts.truncated_sampling_tokens == 2
        assert r.counts.truncated_sampling_context_tokens == (0 if corrected else 2)


def test_greedy_tokens_stay_as_context():
    r = AgentRecord(0, LIMITS)
    r.add([1, 2], [10, 3], [-0.0, -0.0], hit_length=False, temperature=0.0)
    r.add([1, 2, 10, 3, 7], [11, 3], [-0.3, -0.4], hit_length=False, temperature=1.3)
    (seq,) = r.sequences
    assert seq.loss_mask == [0, 0, 0, 1, 1] and seq.temperatures == [0.0, 0.0, 0.0, 1.3, 1.3]
    assert r.counts.greedy_tokens == 2


def test_hermes_tool_calls_become_openai_tool_calls():
    content, calls = parse_tool_calls(
        'Let me look. <tool_call>{"name": "lookup", "arguments": {"record": "3 1"}}</tool_call>', "hermes"
    )
    assert content == "Let me look."
    assert (
        calls[0]["function"] == {"name": "lookup", "arguments": '{"record": "3 1"}'} and calls[0]["type"] == "function"
    )
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
    f.write_text(
        "import threading\nLOCK = threading.Lock()\n\ndef agent(row, client):\n    with LOCK:\n        return 0.0\n"
    )
    env = AgentEnv(path=str(f), name="agent")
    with pytest.raises(EnvError, match="locked.py cannot be sent to the process agents run in"):
        env.check(Prompt(text="q", label="1"), None)
    (tmp_path / "fine.py").write_text("def agent(row, client):\n    return 0.0\n")
    AgentEnv(path=str(tmp_path / "fine.py"), name="agent").check(Prompt(text="q", label="1"), None)


def test_a_trajectory_s_further_sequences_share_its_advantage_and_count_once():
    """GRPO over 2 prompts x 2 trajectories, trajectory 1 with two further sequences: the group's
    mean and spread are over its trajectories (not weighted by sequences), every further sequence
    takes its trajectory's advantage, and the metrics' rewards are the trajectories'."""
    from hydra.utils import instantiate

    from rlhf_orch.orchestration.loop import sample_values_by_index
    from rlhf_orch.transfer.engine_side import RolloutMeta
    from tests.conftest import compose_config

    extras = [extra_sequence_index(1, 1), extra_sequence_index(1, 2)]
    meta = RolloutMeta(
        indices=[0, 1, 2, 3, *extras],
        seq_lens=[5] * 6,
        response_lens=[3] * 6,
        rewards=[0.0, 1.0, 0.5, 0.5, 0.7, 0.2],
        truncated=[False] * 6,
        weight_versions=[0] * 6,
    )
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
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"record": {"type": "string"}}},
            },
        }
    ]
    content, calls = parse_tool_calls('{"name": "lookup", "parameters": {"record": "3 1"}}', "llama3_json", tok, tools)
    assert [c["function"]["name"] for c in calls] == ["lookup"] and json.loads(calls[0]["function"]["arguments"]) == {
        "record": "3 1"
    }
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
    assert (
        "reasoning_content" not in completion_body("policy", text, "stop", 5, 9, "hermes", tok)["choices"][0]["message"]
    )


def test_content_is_empty_text_without_tool_calls_and_null_beside_them():
    from rlhf_orch.env.agent_driver.chat_api import completion_body

    def message(text):
        return completion_body("policy", text, "stop", 3, 1, "hermes")["choices"][0]["message"]

    assert message("")["content"] == "" and "tool_calls" not in message("")
    call_only = message('<tool_call>{"name": "lookup", "arguments": {"record": "3"}}</tool_call>')
    assert call_only["content"] is None and call_only["tool_calls"][0]["function"]["name"] == "lookup"
    assert message("hi")["content"] == "hi"


def _plain(kind: str) -> dict:
    from rlhf_orch.env.agent_driver.chat_api import completion_body

    call = '<tool_call>{"name": "lookup", "arguments": {"x": 3}}</tool_call>'
    plain = completion_body(
        "policy",
        "Looking." + call if kind == "text_and_call" else call if kind == "call_only" else "42",
        "stop",
        12,
        20,
        "hermes",
    )
    if kind == "empty_reasoning":  # (what a reasoning parser gives for <think></think>)
        plain["choices"][0]["message"]["reasoning_content"] = ""
    return plain


@pytest.mark.parametrize("kind", ["text_and_call", "call_only", "empty_reasoning"])
def test_a_streamed_completion_reassembles_to_the_plain_one(kind):
    """stream=true: the chunks OpenAI's clients add up -- role, reasoning, content, each tool call at
    its index, the finish reason, the usage when asked -- give back the plain completion's message,
    null content (tool calls only) and empty reasoning included."""
    import json

    from rlhf_orch.env.agent_driver.chat_api import stream_events

    call = parse_request(_body(stream=True, stream_options={"include_usage": True}), "policy")
    assert call.stream and call.include_usage
    assert not parse_request(_body(stream=None, stream_options={}), "policy").stream
    plain = _plain(kind)
    events = stream_events(plain, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {plain["id"]}
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"] == plain["usage"]
    assert chunks[-1]["choices"] == []
    message, calls = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        for key, value in choice["delta"].items():
            if key == "tool_calls":
                calls.update({tc["index"]: {k: v for k, v in tc.items() if k != "index"} for tc in value})
            elif key in message and isinstance(value, str):
                message[key] = (message[key] or "") + value
            else:
                message[key] = value
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    expected = plain["choices"][0]
    assert message == expected["message"], kind
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [
        expected["finish_reason"]
    ]
    assert b"usage" not in stream_events(plain, include_usage=False)


def test_n_choices_stream_each_at_its_index_and_add_up_to_the_merged_completion():
    import json

    from rlhf_orch.env.agent_driver.chat_api import merged_choices, stream_events

    merged = merged_choices([_plain("text_and_call"), _plain("empty_reasoning")])
    assert [c["index"] for c in merged["choices"]] == [0, 1]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}
    chunks = [json.loads(e[len("data: ") :]) for e in stream_events(merged).decode().split("\n\n")[:-2]]
    messages: dict[int, dict] = {}
    for c in chunks:
        (choice,) = c["choices"]
        message = messages.setdefault(choice["index"], {})
        for key, value in choice["delta"].items():
            if key == "tool_calls":
                message.setdefault(key, []).extend({k: v for k, v in tc.items() if k != "index"} for tc in value)
            elif key in message and isinstance(value, str):
                message[key] = (message[key] or "") + value
            else:
                message[key] = value
    assert [messages[k] for k in (0, 1)] == [c["message"] for c in merged["choices"]]


def test_the_driver_says_once_per_run_what_did_not_train_as_sampled():
    env = AgentEnv(path="scripts/examples/openai_agent.py", name="three_tries")
    step = env.metrics({"trajectories": 4.0, "sampling_overridden": 2.0, "greedy_tokens": 6.0})
    first = env.notices(step)
    assert [line.split(":")[0] for line in first] == ["env.sampling=run", "env=agent"]
    assert "greedy" in first[1] and env.notices(step) == []  # once per run
    trained = env.metrics({"trajectories": 4.0, "truncated_sampling_tokens": 9.0})
    assert env.notices(trained) == []  # trained: the run weighs them by the engine's probability
    context = env.metrics(
        {"trajectories": 4.0, "truncated_sampling_tokens": 9.0, "truncated_sampling_context_tokens": 9.0}
    )
    assert context["env/truncated_sampling_context_tokens"] == 9.0 and "top_p" in env.notices(context)[0]


def test_a_responses_agent_s_chained_calls_extend_one_sequence_on_smollm2_s_chat_template(smollm2_tokenizer):
    """SmolLM2's real ChatML template: a Responses API call, then one chained on it by
    previous_response_id (with instructions both times), render so that the second prompt holds the
    first prompt and the model's own tokens (its answer and <|im_end|>): one sequence, the user's
    new turn as context; the first question asked again branches at the first prompt's end."""
    from rlhf_orch.env.agent_driver.chat_api import completion_body
    from rlhf_orch.env.agent_driver.responses_api import conversation_messages, parse_responses_request
    from rlhf_orch.env.observations import token_ids

    tok = smollm2_tokenizer

    def render(call):
        messages = parse_request(call.chat_body | {"model": "policy"}, "policy").messages
        return token_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=200, max_tokens_per_call=20, max_calls=8)
    r = AgentRecord(0, limits)
    first = parse_responses_request({"model": "policy", "instructions": "Be brief.", "input": "2+3?"}, None)
    prompt1 = render(first)
    answer = tok("5", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    r.add(prompt1, answer, [-0.1] * len(answer), hit_length=False)
    history = conversation_messages(first, completion_body("policy", "5", "stop", len(prompt1), len(answer), "none"))
    second = parse_responses_request(
        {"model": "policy", "instructions": "Be brief.", "previous_response_id": "resp_1", "input": "And 2+4?"}, history
    )
    prompt2 = render(second)
    r.add(prompt2, answer, [-0.2] * len(answer), hit_length=False)
    (seq,) = r.sequences
    assert seq.prompt_ids == prompt1 and seq.response_ids[: len(answer)] == answer
    context = tok.decode(seq.response_ids[len(answer) : len(prompt2) - len(prompt1)])
    assert "And 2+4?" in context and "Be brief." not in context  # the new turn, the instructions once
    assert (r.counts.unmerged_calls, r.counts.branches) == (0, 0)
    # the first question asked again (a regenerated answer): a branch at the first prompt's end
    r.add(render(first), answer, [-0.3] * len(answer), hit_length=False)
    assert (r.counts.unmerged_calls, r.counts.branches) == (0, 1)
    assert r.sequences[1].prompt_ids == prompt1 and r.sequences[1].response_ids == answer
