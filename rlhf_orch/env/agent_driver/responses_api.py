"""The OpenAI Responses API (`POST /v1/responses`), as the `env=agent` endpoint speaks it (pure: no HTTP).

Agents written against the Responses API (the openai SDK's `client.responses`, Codex, the Agents SDK)
are served by mapping each call onto a chat-completions call (`chat_api`): what the engine samples
and what is recorded for training is then the same conversation a chat-completions agent would give.

`parse_responses_request` turns a request body into a chat-completions body (`ResponsesCall.chat_body`,
for `chat_api.parse_request`, which checks it as it checks any chat call: the model, the sampling
settings, max_tokens); what the chat format has no room for is refused with an OpenAI-style error
(`ChatAPIError`): hosted tools (web search, file search, code interpreter...), images and files,
structured output, server-side conversations and background runs. A `previous_response_id` chains
on the chat messages stored for that response (`conversation_messages`; the caller keeps them).

`response_body` answers with a `response` object made from the chat completion, and
`response_stream_events` streams it as the Responses API does (typed server-sent events). As with
chat_api's streaming, the completion is generated whole before the first event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from rlhf_orch.env.agent_driver.chat_api import ChatAPIError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Accepted and ignored: they change nothing the engine samples or the trainers see (the ones the
# response object has are echoed back in it).
_IGNORED = (
    "store",
    "metadata",
    "parallel_tool_calls",
    "tool_choice",
    "include",
    "truncation",
    "text",
    "reasoning",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "top_logprobs",
    "stream_options",
    "background",
    "conversation",
    "prompt",
    "max_tool_calls",
)
_KNOWN = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
)
_ECHOED_IF_GIVEN = ("prompt_cache_key", "safety_identifier", "top_logprobs", "max_tool_calls")


@dataclass
class ResponsesCall:
    chat_body: dict[str, Any]  # a chat-completions request body, for chat_api.parse_request (never streamed)
    stream: bool = False  # answered as the Responses API's server-sent events (`response_stream_events`)
    previous_response_id: str | None = None
    store: bool = True  # (as OpenAI) keep the conversation for a later previous_response_id
    request: dict[str, Any] = field(default_factory=dict)  # the request's fields a response object echoes


def parse_responses_request(body: Any, history: list[dict[str, Any]] | None) -> ResponsesCall:
    """The chat-completions call a Responses API request body asks for, or ChatAPIError naming the
    parameter and why. `history` is the chat messages stored for the response `previous_response_id`
    names (`conversation_messages`), None when the request has no previous id (or it is unknown)."""
    if not isinstance(body, Mapping):
        raise ChatAPIError(400, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in (*_KNOWN, *_IGNORED))
    if unknown:
        raise ChatAPIError(400, f"unsupported parameter(s) {', '.join(unknown)}", unknown[0])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ChatAPIError(400, f"stream={stream!r} must be true or false", "stream")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise ChatAPIError(400, f"store={store!r} must be true or false", "store")
    _refuse_what_chat_cannot_do(body)

    previous_response_id = body.get("previous_response_id")
    if previous_response_id is not None and not isinstance(previous_response_id, str):
        raise ChatAPIError(400, "previous_response_id must be a string", "previous_response_id")
    if previous_response_id is not None and history is None:
        raise ChatAPIError(404, f"previous response with id {previous_response_id!r} not found", "previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatAPIError(400, "instructions must be a string", "instructions")
    messages: list[dict[str, Any]] = []
    # The call's own instructions, never the previous call's (as OpenAI: instructions are not carried
    # over a previous_response_id; the stored history has none).
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += [dict(m) for m in history or []]
    messages += _input_messages(body.get("input"))

    tools = _chat_tools(body.get("tools"))
    chat_body: dict[str, Any] = {"messages": messages, "stream": False}
    if "model" in body:
        chat_body["model"] = body["model"]
    if tools:
        chat_body["tools"] = tools
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int) or max_output_tokens < 1:
            raise ChatAPIError(
                400, f"max_output_tokens={max_output_tokens!r} must be a positive integer", "max_output_tokens"
            )
        chat_body["max_tokens"] = max_output_tokens
    for key in ("temperature", "top_p"):  # (read by chat_api as a chat call's: env.sampling)
        if body.get(key) is not None:
            chat_body[key] = body[key]

    text = body.get("text")
    request: dict[str, Any] = {
        "instructions": instructions,
        "tools": list(body.get("tools") or []),
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") if body.get("parallel_tool_calls") is not None else True,
        # (unset: the run's, which this layer does not know; the type allows null)
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": max_output_tokens,
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}} | dict(text or {}),
        "truncation": body.get("truncation") or "disabled",
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "user": body.get("user"),
    }
    request |= {k: body[k] for k in _ECHOED_IF_GIVEN if body.get(k) is not None}
    return ResponsesCall(
        chat_body,
        stream=bool(stream),
        previous_response_id=previous_response_id,
        store=True if store is None else store,
        request=request,
    )


def _refuse_what_chat_cannot_do(body: Mapping[str, Any]) -> None:
    """ChatAPIError for the accepted parameters' values the chat format cannot carry out."""
    text = body.get("text")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ChatAPIError(400, "text must be an object", "text")
        fmt = text.get("format")
        kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
        if fmt is not None and kind != "text":
            # The model writes free text here: a schema is not enforced on what it samples.
            raise ChatAPIError(400, f"text.format={kind!r}: structured output is not supported", "text.format")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise ChatAPIError(400, f"truncation={body['truncation']!r} must be 'disabled' or 'auto'", "truncation")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise ChatAPIError(400, "reasoning must be an object", "reasoning")
    if body.get("background"):
        raise ChatAPIError(400, "background=true: responses are answered in the request here", "background")
    if body.get("conversation") is not None:
        raise ChatAPIError(400, "conversation is not supported: chain calls with previous_response_id", "conversation")
    if body.get("prompt") is not None:
        raise ChatAPIError(400, "prompt (a stored prompt template) is not supported: send instructions", "prompt")


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`: a string (one user message) or a list of items."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ChatAPIError(400, "input must be a string or a non-empty list of input items", "input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ChatAPIError(400, f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ChatAPIError(400, f"{where}.role={role!r} must be one of {', '.join(_ROLES)}", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning is not None:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call":
            call = {
                "id": _string_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string_field(item, "name", where),
                    "arguments": _string_field(item, "arguments", where),
                },
            }
            # Parallel calls (and the text before them) are one assistant turn in the chat format: the
            # model wrote them in one completion, which the chat template renders as one message.
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string_field(item, "call_id", where),
                    "content": _text_of(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            # The reasoning of the assistant turn that follows, as its `reasoning_content` (what the
            # chat completion answered it with): a template that renders past reasoning (Qwen3 within
            # a tool loop) then renders the turn as the model wrote it, and the call extends the sequence.
            parts = item.get("content") or item.get("summary") or []
            texts = [p.get("text") for p in parts if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
            reasoning = "".join(texts)
        else:
            raise ChatAPIError(400, f"{where}: input items of type {kind!r} are not supported", f"{where}.type")
    return messages


def _string_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ChatAPIError(400, f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatAPIError(400, f"{where} must be a string or a list of content parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":  # (an assistant message sent back as the API gave it)
            texts.append(str(part.get("refusal", "")))
        else:
            # Images, files and audio: the policy is trained on text; nothing renders them.
            raise ChatAPIError(
                400, f"{where}[{k}]: content parts of type {kind!r} are not supported", f"{where}[{k}].type"
            )
    return "".join(texts)


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools in the chat format; hosted tools (web search, file search, computer use, code
    interpreter, MCP...) would need OpenAI's servers to run them, so they are refused."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatAPIError(400, "tools must be a list of tool definitions", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise ChatAPIError(
                400, f"tools[{i}]: tools of type {kind!r} are not supported (only type 'function')", f"tools[{i}].type"
            )
        function = {"name": _string_field(tool, "name", f"tools[{i}]")}
        function |= {k: tool[k] for k in ("description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def conversation_messages(call: ResponsesCall, completion: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages to store under a response's id for a later `previous_response_id`: the call's
    messages less its instructions (the next call brings its own) and the completion's assistant
    message (content and tool calls, arguments as JSON strings) -- the messages an agent sending the
    whole conversation back as input items would give."""
    messages = [dict(m) for m in call.chat_body["messages"]]
    if call.request.get("instructions"):
        messages = messages[1:]
    message = completion["choices"][0]["message"]
    assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        assistant["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        assistant["tool_calls"] = [dict(c) | {"function": dict(c["function"])} for c in message["tool_calls"]]
    return messages + [assistant]


def response_body(call: ResponsesCall, completion: Mapping[str, Any], response_id: str) -> dict[str, Any]:
    """A Responses API `response` object from a chat completion (`chat_api.completion_body`): its
    output items -- the reasoning, the text, each tool call -- and the request's echoed settings."""
    choice = completion["choices"][0]
    message = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": "completed",
            }
        )
    tool_calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    # (as OpenAI: a message item for the text; tool calls alone have none)
    if content or not tool_calls:
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "incomplete" if incomplete else "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}],
            }
        )
    for tool_call in tool_calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": tool_call["id"],
                "name": tool_call["function"]["name"],
                "arguments": _arguments_text(tool_call["function"]["arguments"]),
                "status": "completed",
            }
        )
    usage = completion["usage"]
    return {
        "id": response_id,
        "object": "response",
        "created_at": completion["created"],
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": completion["model"],
        "output": output,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},  # (no prompt cache here)
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "previous_response_id": call.previous_response_id,
        "store": call.store,
        "background": False,
        "service_tier": "default",
        **call.request,
    }


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def response_stream_events(response: Mapping[str, Any]) -> bytes:
    """A finished response (`response_body`) as the Responses API streams it: server-sent events
    `event: <type>` / `data: <json>`, numbered by `sequence_number` -- response.created and
    .in_progress (no output yet), then each output item added, its content in one delta, its part
    and the item done, and last response.completed (or .incomplete) with the whole response. No
    `[DONE]` line: the Responses API ends with the last event."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    pending = dict(response) | {"status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for i, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []})
            for k, part in enumerate(item["content"]):
                emit("response.content_part.added", **at, content_index=k, part=part | {"text": ""})
                emit("response.output_text.delta", **at, content_index=k, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **at, content_index=k, text=part["text"], logprobs=[])
                emit("response.content_part.done", **at, content_index=k, part=part)
        elif item["type"] == "function_call":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        elif item["type"] == "reasoning":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []})
            for k, part in enumerate(item.get("content") or []):
                emit("response.content_part.added", **at, content_index=k, part=part | {"text": ""})
                emit("response.reasoning_text.delta", **at, content_index=k, delta=part["text"])
                emit("response.reasoning_text.done", **at, content_index=k, text=part["text"])
                emit("response.content_part.done", **at, content_index=k, part=part)
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
