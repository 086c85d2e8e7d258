"""`env=agent`'s Responses API (`POST /v1/responses`) without an engine: requests mapped onto
chat-completions calls (the same conversation a chat agent gives), what is refused, the response
objects and their server-sent events -- checked with the openai package's own types and client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent

from rlhf_orch.env.agent_driver.chat_api import ChatAPIError, completion_body, parse_request
from rlhf_orch.env.agent_driver.responses_api import (
    ResponsesCall,
    conversation_messages,
    parse_responses_request,
    response_body,
    response_stream_events,
)

CALL = '<tool_call>{"name": "lookup", "arguments": {"record": 3}}</tool_call>'
TWO_CALLS = CALL + '<tool_call>{"name": "lookup", "arguments": {"record": 4}}</tool_call>'
LOOKUP = {"type": "function", "name": "lookup", "description": "Look a record up.", "parameters": {"type": "object"}}
# Fields the installed openai types do not declare yet that OpenAI's API reference shows.
_UNDECLARED = {"ResponseFunctionCallArgumentsDoneEvent": {"name"}, "Response": {"store"}}


def _completion(kind: str) -> dict[str, Any]:
    """A chat completion as the endpoint makes it (`completion_body`, Hermes tool calls)."""
    text = {"text": "42", "tool_call": CALL, "text_and_calls": "Looking." + TWO_CALLS, "reasoning": "It is 42."}
    completion = completion_body(
        "policy", text.get(kind, "The answer is"), "length" if kind == "incomplete" else "stop", 12, 20, "hermes"
    )
    if kind == "reasoning":  # (what env.reasoning_parser gives for <think>...</think>)
        completion["choices"][0]["message"]["reasoning_content"] = "The record says 42."
    return completion


def _strict(model: pydantic.BaseModel, path: str = "") -> None:
    """Every field of the validated object is one the openai types declare: their models allow extra
    keys, which would let a misspelt field through."""
    extra = set(model.model_extra or {}) - _UNDECLARED.get(type(model).__name__, set())
    assert not extra, f"{path or type(model).__name__}: fields the openai types do not have: {sorted(extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for k, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, pydantic.BaseModel):
                _strict(v, f"{path}.{name}[{k}]")


def _response(body: dict[str, Any]) -> Response:
    response = Response.model_validate(body, strict=True)
    _strict(response)
    return response


def _call(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> ResponsesCall:
    return parse_responses_request({"model": "policy", **body}, history)


# --------------------------------------------------------------------------- requests
def test_a_string_input_is_one_user_message_after_the_instructions():
    call = _call({"input": "What is 6*7?", "instructions": "Answer briefly.", "max_output_tokens": 7, "top_p": 1.0})
    assert call.chat_body == {
        "model": "policy",
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6*7?"}],
        "stream": False,
        "max_tokens": 7,
        "top_p": 1.0,
    }
    assert (call.stream, call.store, call.previous_response_id) == (False, True, None)
    chat = parse_request(call.chat_body, "policy")
    assert chat.max_tokens == 7 and not chat.stream and chat.tools is None
    # The sampling settings reach chat_api, which reads them as a chat call's (env.sampling).
    sampled = parse_request(_call({"input": "hi", "temperature": 0.2, "top_p": 0.9}).chat_body, "policy")
    assert (sampled.sampling.temperature, sampled.sampling.top_p) == (0.2, 0.9)


def test_message_items_with_content_parts_join_to_text():
    call = _call(
        {
            "input": [
                {"role": "developer", "content": "Use the tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Record "}, {"type": "input_text", "text": "3?"}],
                },
                # an output message sent back as the API gave it (id, status, annotations)
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "It is 42.", "annotations": []}],
                },
                {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
            ],
            "stream": True,
            "store": False,
        }
    )
    assert call.chat_body["messages"] == [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Record 3?"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "Thanks"},
    ]
    assert call.stream and not call.store and call.chat_body["stream"] is False
    assert parse_request(call.chat_body, "policy").messages == call.chat_body["messages"]


def test_parallel_function_calls_merge_into_one_assistant_turn_carrying_the_reasoning_before_it():
    """Two function_call items (and the text before them) are one assistant message with two
    tool_calls, followed by the two tool messages; a reasoning item leaves no message of its own: its
    text is the next assistant turn's reasoning_content (as the chat completion answered it)."""
    call = _call(
        {
            "input": [
                {"role": "user", "content": "Records 3 and 4?"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Two lookups."}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_a",
                    "name": "lookup",
                    "arguments": '{"record": 3}',
                },
                {
                    "type": "function_call",
                    "call_id": "call_b",
                    "name": "lookup",
                    "arguments": '{"record": 4}',
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "call_a", "output": "three"},
                {
                    "type": "function_call_output",
                    "call_id": "call_b",
                    "output": [{"type": "input_text", "text": "four"}],
                },
            ],
            "tools": [LOOKUP | {"strict": False}],
        }
    )
    assert call.chat_body["messages"] == [
        {"role": "user", "content": "Records 3 and 4?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "Two lookups.",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": '{"record": 3}'}},
                {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": '{"record": 4}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "three"},
        {"role": "tool", "tool_call_id": "call_b", "content": "four"},
    ]
    assert call.chat_body["tools"] == [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Look a record up.", "parameters": {"type": "object"}},
        }
    ]
    chat = parse_request(call.chat_body, "policy")
    assert [c["function"]["arguments"] for c in chat.messages[1]["tool_calls"]] == [{"record": 3}, {"record": 4}]
    # Function calls alone (no text before them) are an assistant message with null content, as in chat.
    only_calls = _call({"input": [{"type": "function_call", "call_id": "c", "name": "lookup", "arguments": "{}"}]})
    assert only_calls.chat_body["messages"][0]["content"] is None


def test_previous_response_id_chains_the_stored_history_and_the_new_instructions_replace_the_old():
    first = _call({"input": "Records 3 and 4?", "instructions": "Old rules.", "tools": [LOOKUP]})
    completion = _completion("text_and_calls")
    stored = conversation_messages(first, completion)
    message = completion["choices"][0]["message"]
    assert stored == [
        {"role": "user", "content": "Records 3 and 4?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": message["tool_calls"]},
    ]
    calls = message["tool_calls"]
    outputs = [
        {"type": "function_call_output", "call_id": c["id"], "output": f"record {k}"} for k, c in enumerate(calls)
    ]
    chained = _call({"input": outputs, "instructions": "New rules.", "previous_response_id": "resp_1"}, stored)
    assert chained.previous_response_id == "resp_1"
    assert chained.chat_body["messages"] == [
        {"role": "system", "content": "New rules."},
        *stored,
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "record 0"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "record 1"},
    ]
    # An agent that keeps the conversation itself (store=false) sends the first response's output
    # items back as input: the same chat messages result.
    output = response_body(first, completion, "resp_1")["output"]
    stateless = _call(
        {"input": [{"role": "user", "content": "Records 3 and 4?"}, *output, *outputs], "instructions": "New rules."}
    )
    assert stateless.chat_body["messages"] == chained.chat_body["messages"]
    # The caller found no response under the id: OpenAI's 404.
    with pytest.raises(ChatAPIError) as missing:
        _call({"input": "hi", "previous_response_id": "resp_gone"}, None)
    assert (missing.value.status, missing.value.param) == (404, "previous_response_id")


def test_max_output_tokens_is_the_chat_call_s_max_tokens():
    assert parse_request(_call({"input": "hi", "max_output_tokens": 64}).chat_body, "policy").max_tokens == 64
    assert "max_tokens" not in _call({"input": "hi"}).chat_body


@pytest.mark.parametrize(
    "patch, param, words",
    [
        ({"tools": [LOOKUP, {"type": "web_search"}]}, "tools[1].type", "'web_search'"),
        (
            {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
            "tools[0].type",
            "'code_interpreter'",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": "x"}],
                    }
                ]
            },
            "input[0].content[1].type",
            "'input_image'",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}
                ]
            },
            "input[0].output[0].type",
            "'input_file'",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference'"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            "text.format",
            "structured output is not supported",
        ),
        ({"text": {"format": {"type": "json_object"}}}, "text.format", "structured output is not supported"),
        (
            {"seed": 1, "frequency_penalty": 0.1},
            "frequency_penalty",
            "unsupported parameter(s) frequency_penalty, seed",
        ),
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"input": []}, "input", "non-empty"),
        ({"input": 7}, "input", "a string or a non-empty list"),
        ({"input": ["hi"]}, "input[0]", "must be an object"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "string"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name", "string"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments",
            "",
        ),
        ({"store": "yes"}, "store", "true or false"),
        ({"instructions": ["be brief"]}, "instructions", "string"),
        ({"previous_response_id": 7}, "previous_response_id", "string"),
        ({"tools": {"type": "function", "name": "f"}}, "tools", "list"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "name"),
        ({"truncation": "sometimes"}, "truncation", "truncation"),
        ({"reasoning": "high"}, "reasoning", "reasoning"),
        ({"text": "plain"}, "text", "text"),
    ],
)
def test_what_the_chat_format_cannot_carry_is_refused_naming_the_parameter(patch, param, words):
    with pytest.raises(ChatAPIError) as refused:
        _call({"input": "hi"} | patch)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert words in refused.value.message and refused.value.body()["error"]["param"] == param


def test_settings_that_change_nothing_sampled_are_accepted_and_echoed():
    given = {
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "metadata": {"task": "7"},
        "include": ["reasoning.encrypted_content"],
        "truncation": "auto",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "user": "agent-1",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "top_logprobs": 0,
        "stream_options": {"include_obfuscation": False},
        "background": False,
        "conversation": None,
        "prompt": None,
        "max_tool_calls": 3,
        "store": True,
    }
    call = _call({"input": "hi", "tools": [LOOKUP]} | given)
    assert set(call.chat_body) == {"model", "messages", "tools", "stream"}
    body = _response(response_body(call, _completion("text"), "resp_1")).to_dict()
    for key in ("tool_choice", "parallel_tool_calls", "metadata", "truncation", "text", "user", "max_tool_calls"):
        assert body[key] == given[key], key
    assert body["reasoning"] == {"effort": "low", "summary": "auto"} and body["tools"] == [LOOKUP]


# --------------------------------------------------------------------------- responses
@pytest.mark.parametrize("kind", ["text", "tool_call", "text_and_calls", "reasoning", "incomplete"])
def test_a_response_body_is_a_valid_openai_response(kind):
    call = _call({"input": "Record 3?", "instructions": "Be brief.", "tools": [LOOKUP], "max_output_tokens": 20})
    completion = _completion(kind)
    message = completion["choices"][0]["message"]
    body = response_body(call, completion, "resp_abc")
    response = _response(body)
    assert (response.id, response.object, response.model, response.created_at) == (
        "resp_abc",
        "response",
        "policy",
        completion["created"],
    )
    assert (
        response.usage.input_tokens == 12 and response.usage.output_tokens == 20 and response.usage.total_tokens == 32
    )
    assert (
        response.instructions == "Be brief." and response.max_output_tokens == 20 and response.tools[0].name == "lookup"
    )
    # (temperature and top_p unset: the run's, which the response leaves null)
    assert (response.tool_choice, response.parallel_tool_calls, response.temperature, response.top_p) == (
        "auto",
        True,
        None,
        None,
    )
    assert (response.store, response.background, response.truncation, response.metadata) == (
        True,
        False,
        "disabled",
        {},
    )
    types = [item.type for item in response.output]
    expected = {
        "text": ["message"],
        "tool_call": ["function_call"],
        "text_and_calls": ["message", "function_call", "function_call"],
        "reasoning": ["reasoning", "message"],
        "incomplete": ["message"],
    }[kind]
    assert types == expected
    assert response.output_text == (message["content"] or "")
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls") or []
    ]
    assert all(c.id.startswith("fc_") and c.status == "completed" for c in calls)
    if kind == "reasoning":
        assert response.output[0].content[0].text == "The record says 42." and response.output[0].id.startswith("rs_")
    if kind == "incomplete":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert "output_text" not in body  # (the SDK's property, not a field of the API's object)


def _events(sse: bytes) -> list[dict[str, Any]]:
    """The events of a stream as the openai package reads server-sent events, each validated
    strictly as one of its `ResponseStreamEvent` types."""
    from openai._streaming import SSEDecoder

    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = []
    for sse_event in SSEDecoder().iter_bytes(iter([sse])):
        data = sse_event.json()
        assert sse_event.event == data["type"]
        _strict(adapter.validate_python(data, strict=True))
        events.append(data)
    return events


@pytest.mark.parametrize("kind", ["text", "tool_call", "text_and_calls", "reasoning", "incomplete"])
def test_a_streamed_response_adds_up_to_the_response(kind):
    call = _call({"input": "Record 3?", "tools": [LOOKUP], "stream": True})
    body = response_body(call, _completion(kind), "resp_abc")
    sse = response_stream_events(body)
    assert not sse.endswith(b"data: [DONE]\n\n") and sse.endswith(b"\n\n")
    events = _events(sse)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert all(e["response"]["status"] == "in_progress" and e["response"]["output"] == [] for e in events[:2])
    # Each item: added, its content part(s) opened, the text in one delta, closed, done (OpenAI's order).
    per_item = {
        "message": ["content_part.added", "output_text.delta", "output_text.done", "content_part.done"],
        "reasoning": ["content_part.added", "reasoning_text.delta", "reasoning_text.done", "content_part.done"],
        "function_call": ["function_call_arguments.delta", "function_call_arguments.done"],
    }
    expected = [
        t for item in body["output"] for t in ["output_item.added", *per_item[item["type"]], "output_item.done"]
    ]
    assert [e["type"] for e in events[2:-1]] == [f"response.{t}" for t in expected]
    last = events[-1]
    assert last["type"] == ("response.incomplete" if kind == "incomplete" else "response.completed")
    assert last["response"] == body and _response(last["response"]).status == body["status"]
    # Added up the way a client does: each item's deltas give the final item's text or arguments.
    texts: dict[tuple[str, int], str] = {}
    for e in events:
        if e["type"] in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            key = (e["item_id"], e.get("content_index", 0))
            texts[key] = texts.get(key, "") + e["delta"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == body["output"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == list(range(len(body["output"])))
    for item, a in zip(body["output"], added):
        assert a["item"]["status"] == "in_progress" and a["item"]["id"] == item["id"]
        if item["type"] == "function_call":
            assert a["item"]["arguments"] == "" and texts[(item["id"], 0)] == item["arguments"]
        else:
            assert a["item"]["content"] == [] and texts[(item["id"], 0)] == item["content"][0]["text"]
    for e in events:
        if e["type"] == "response.function_call_arguments.done":
            item = body["output"][e["output_index"]]
            assert (e["arguments"], e["name"]) == (item["arguments"], item["name"])


# --------------------------------------------------------------------------- the openai client
def _fake_endpoint(stored: dict[str, list[dict[str, Any]]], seen: list[dict[str, Any]], kinds: list[str]):
    """`POST /v1/responses` over this module and chat_api, answering completions of `kinds` in turn:
    what an agent's openai client sends is parsed, and what it is answered is read by the client."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        try:
            call = parse_responses_request(body, stored.get(body.get("previous_response_id")))
            parse_request(call.chat_body, "policy")
        except ChatAPIError as e:
            return httpx.Response(e.status, json=e.body())
        completion = _completion(kinds[len(seen) - 1])
        response_id = f"resp_{len(seen)}"
        stored[response_id] = conversation_messages(call, completion)
        response = response_body(call, completion, response_id)
        if call.stream:
            return httpx.Response(
                200, content=response_stream_events(response), headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json=response)

    return handle


def test_the_openai_client_drives_a_tool_loop_through_the_endpoint():
    """The SDK's own requests parse, its streaming helper adds the events up to the response, and a
    previous_response_id call carries the conversation on."""
    stored: dict[str, list[dict[str, Any]]] = {}
    seen: list[dict[str, Any]] = []
    transport = httpx.MockTransport(_fake_endpoint(stored, seen, ["text_and_calls", "text", "reasoning"]))
    client = OpenAI(
        api_key="unused", base_url="http://agent.test/v1", http_client=httpx.Client(transport=transport), max_retries=0
    )
    tools = [LOOKUP]
    with client.responses.stream(
        model="policy", input="Records 3 and 4?", instructions="Be brief.", tools=tools
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert first.output_text == "Looking." and [item.type for item in first.output] == [
        "message",
        "function_call",
        "function_call",
    ]
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "found"} for item in first.output[1:]
    ]
    second = client.responses.create(
        model="policy", previous_response_id=first.id, input=outputs, instructions="Be brief."
    )
    assert second.output_text == "42" and second.previous_response_id == first.id
    assert stored[second.id][-3:-1] == [
        {"role": "tool", "tool_call_id": o["call_id"], "content": "found"} for o in outputs
    ]
    # store=false: the agent sends the whole conversation back itself.
    items = [
        {"role": "user", "content": "Records 3 and 4?"},
        *[i.model_dump(exclude_none=True) for i in first.output],
        *outputs,
    ]
    third = client.responses.create(model="policy", input=items, instructions="Be brief.", store=False, stream=False)
    assert third.output[0].type == "reasoning" and third.output_text == "It is 42."
    assert stored["resp_3"][:-1] == stored[second.id][:-1]
    # A hosted tool is answered as OpenAI answers a bad request.
    with pytest.raises(Exception) as refused:
        client.responses.create(model="policy", input="hi", tools=[{"type": "web_search"}])
    assert getattr(refused.value, "status_code", None) == 400 and "web_search" in str(refused.value)
