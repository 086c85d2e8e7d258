"""The OpenAI chat-completions wire format, as the `env=agent` endpoint speaks it (pure: no HTTP).

`parse_request` checks a request body against what training can use and returns the call; what
would break training is refused with an OpenAI-style error (`ChatAPIError`): log-probs turned off
(every token's log-prob is what the trainers correct with), another model's name, `logit_bias`.
`max_tokens` / `max_completion_tokens` and `stop` are honoured, capped by the run's limits; `n`
completions come back as n choices, each recorded as its own branch of the conversation.

A call's own sampling (`temperature`, `top_p`, `top_k`, `presence_penalty`, `frequency_penalty`,
`seed`: `CallSampling`) is honoured with `env.sampling=call` (the default: agents keep the settings
they were written with) and replaced by the run's with `env.sampling=run` (the call says which it
overrode: the engine says it once and counts it). The trainers score every token at the temperature
it was sampled at; greedy tokens, and tokens drawn with top-p / top-k / penalties unless the run
weighs tokens by the engine's probability, are kept as context (`record.AgentRecord.add`).
`stream=true` is answered with server-sent events in OpenAI's chunk format (`stream_events`), made
from the same completion a plain call gets: what is recorded for training does not depend on it.

`parse_tool_calls` reads the model's tool calls out of a completion into OpenAI `tool_calls`: Hermes
style (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen's and Hermes' chat templates)
or any format vLLM has a tool parser for (`env.tool_parser=llama3_json`, `mistral`, `qwen3_coder`...).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rlhf_orch.env.reasoning_parsers import NONE, split_reasoning
from rlhf_orch.env.tool_parsers import extract_tool_calls

TOOL_PARSERS = ("hermes", "none")  # built in; any of vLLM's tool parsers besides (rlhf_orch.env.tool_parsers)
_ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted and ignored: they change nothing the engine samples or the trainers see.
_IGNORED = (
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "tool_choice",
    "service_tier",
    "top_logprobs",
    "modalities",
    "reasoning_effort",
)


class ChatAPIError(Exception):
    """An error answered to the agent: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# env.sampling: a call's own sampling settings honoured, or replaced by the run's.
SAMPLING_MODES = ("call", "run")
MAX_CHOICES = 16  # n: completions of one call (each counts against env.max_calls)


@dataclass(frozen=True)
class CallSampling:
    """How one call's tokens are drawn (vLLM's SamplingParams fields; None / off = the run's)."""

    temperature: float | None = None  # None: algo.temperature; 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the run's seed for this call (step, trajectory, call number)

    @property
    def truncates(self) -> bool:
        """Whether the engine draws from other than the whole vocabulary at the temperature (what
        the trainers score): top-p, top-k or a penalty."""
        return self.top_p < 1.0 or self.top_k > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0


# (key, check, what it must be) of each sampling parameter a call may set
# (finite numbers only: JSON's Infinity and NaN compare false to every bound)
_SAMPLING_KEYS = (
    ("temperature", lambda v: 0.0 <= v <= 2.0, "a number in [0, 2]"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    ("top_k", lambda v: isinstance(v, int) and -1 <= v < 2**31, "an integer >= -1 (-1 or 0: off)"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    # the engine seeds a torch.Generator with it (at most 2^64 - 1; -1 would mean unseeded)
    ("seed", lambda v: isinstance(v, int) and 0 <= v < 2**63, "an integer in [0, 2^63)"),
)
# vLLM samples greedily below this temperature (its _SAMPLING_EPS): such a call is greedy here too.
GREEDY_BELOW = 1e-5


def parse_sampling(body: Mapping[str, Any], mode: str) -> tuple[CallSampling, list[str]]:
    """The call's sampling and, with mode "run", the keys it set that the run's settings replace."""
    given: dict[str, float] = {}
    for key, ok, what in _SAMPLING_KEYS:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ChatAPIError(400, f"{key}={value!r} must be {what}", key)
        given[key] = value
    if mode == "run":
        return CallSampling(), sorted(given)
    top_k = int(given.get("top_k", 0))
    return (
        CallSampling(
            temperature=(
                None
                if "temperature" not in given
                else 0.0
                if given["temperature"] < GREEDY_BELOW
                else float(given["temperature"])
            ),
            top_p=float(given.get("top_p", 1.0)),
            top_k=0 if top_k < 0 else top_k,
            presence_penalty=float(given.get("presence_penalty", 0.0)),
            frequency_penalty=float(given.get("frequency_penalty", 0.0)),
            seed=int(given["seed"]) if "seed" in given else None,
        ),
        [],
    )


@dataclass
class ChatCall:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False  # answered as server-sent events (`stream_events`)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # completions, each a branch of the conversation
    sampling: CallSampling = field(default_factory=CallSampling)
    overridden: list[str] = field(default_factory=list)  # env.sampling=run: the call's settings replaced


def parse_request(body: Any, model_name: str, sampling: str = "call") -> ChatCall:
    """The call a request body asks for, or ChatAPIError naming the parameter and why. `sampling`:
    env.sampling ("call": the call's own sampling settings; "run": the run's)."""
    if not isinstance(body, Mapping):
        raise ChatAPIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != model_name:
        raise ChatAPIError(
            404 if model else 400,
            f"model {model!r} is not served here: this run trains one policy, model {model_name!r} (GET /v1/models)",
            "model",
            "model_not_found" if model else "invalid_request_error",
        )
    stream, include_usage = stream_flags(body)
    n = body.get("n", 1)
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ChatAPIError(400, f"n={n!r} must be an integer in [1, {MAX_CHOICES}]", "n")
    if body.get("logprobs") is False:
        raise ChatAPIError(
            400, "logprobs=false: the run records every token's log-prob for training; leave logprobs unset", "logprobs"
        )
    call_sampling, overridden = parse_sampling(body, sampling)
    for key in ("logit_bias",):
        if body.get(key):
            raise ChatAPIError(400, f"{key} changes what the policy samples, which training could not correct for", key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ChatAPIError(
            400, "structured output is not supported: response_format may only be {'type': 'text'}", "response_format"
        )
    unknown = sorted(
        k
        for k in body
        if k
        not in (
            "model",
            "messages",
            "tools",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "n",
            "logprobs",
            "temperature",
            "top_p",
            "top_k",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "stream",
            "stream_options",
            "logit_bias",
            "response_format",
            *_IGNORED,
        )
    )
    if unknown:
        raise ChatAPIError(400, f"unsupported parameter(s) {', '.join(unknown)}", unknown[0])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatAPIError(400, "messages must be a non-empty list of chat messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            raise ChatAPIError(
                400, f"messages[{i}] must be an object with a role among {', '.join(_ROLES)}", "messages"
            )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatAPIError(400, "tools must be a list of tool definitions", "tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ChatAPIError(400, f"max_tokens={max_tokens!r} must be a positive integer", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    return ChatCall(
        [_plain_message(m) for m in messages],
        tools or None,
        max_tokens,
        stop,
        stream=stream,
        include_usage=include_usage,
        n=n,
        sampling=call_sampling,
        overridden=overridden,
    )


def stream_flags(body: Any) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a request body: the one reading of them, by
    `parse_request` and by the server choosing how to answer; ChatAPIError for a bad value."""
    if not isinstance(body, Mapping):
        return False, False
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ChatAPIError(400, f"stream={stream!r} must be true or false", "stream")
    options = body.get("stream_options")
    if options and (not stream or not isinstance(options, Mapping)):
        raise ChatAPIError(400, "stream_options is an object, and only with stream=true", "stream_options")
    return bool(stream), bool(stream and (options or {}).get("include_usage"))


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content parts joined, tool-call arguments as dicts."""
    m = dict(message)
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        m["content"] = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            call["function"] = fn
            calls.append(call)
        m["tool_calls"] = calls
    return m


def parse_tool_calls(
    text: str, parser: str, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a completion's text in OpenAI's layout (`rlhf_orch.env.tool_parsers`:
    Hermes here, other formats by vLLM's parsers). Calls that do not parse stay in the content: the
    agent sees what the model wrote."""
    content, calls = extract_tool_calls(text, parser, tokenizer, tools)
    valid = [c for c in calls if c.error is None]
    if not valid:
        return text, []
    return content, [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments),
            },
        }
        for c in valid
    ]


def completion_body(
    model_name: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    tool_parser: str,
    tokenizer: Any = None,
    tools: list[dict[str, Any]] | None = None,
    reasoning_parser: str = NONE,
) -> dict[str, Any]:
    reasoning, text = split_reasoning(text, reasoning_parser, tokenizer)
    content, tool_calls = parse_tool_calls(text or "", tool_parser, tokenizer, tools)
    # As OpenAI answers: an empty text completion is "" (what its tokens decode to, what trains);
    # beside tool calls, no text is null.
    message: dict[str, Any] = {"role": "assistant", "content": (content or None) if tool_calls else (content or "")}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def merged_choices(completions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The answer to a call with n > 1: the n one-choice completions (`completion_body`) as one, its
    choices indexed 0..n-1, the prompt counted once and every choice's tokens in the usage."""
    first = dict(completions[0])
    first["choices"] = [dict(c["choices"][0], index=k) for k, c in enumerate(completions)]
    prompt = first["usage"]["prompt_tokens"]
    generated = sum(c["usage"]["completion_tokens"] for c in completions)
    first["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    return first


def stream_events(completion: Mapping[str, Any], include_usage: bool = False) -> bytes:
    """A finished completion (`completion_body`, `merged_choices`) as OpenAI streams it: server-sent
    events of `chat.completion.chunk`s, per choice (at its index) the role, the reasoning, the
    content, each tool call (its id, name and arguments in one delta, at its index) and the finish
    reason; the usage in a last chunk with no choices when asked (stream_options.include_usage);
    then `[DONE]`. The completion is generated whole before the first event: what trains is the
    same as for a plain call."""
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    if include_usage:  # (as OpenAI: every chunk before the last carries "usage": null)
        base["usage"] = None

    chunks = []
    for choice in completion["choices"]:
        message = choice["message"]

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return base | {
                "choices": [
                    {"index": choice["index"], "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ]
            }

        # The first delta's content is what the added-up message starts from: null where the plain
        # message's is (tool calls and no text), so the agent sends back the message it would have.
        chunks.append(chunk({"role": "assistant", "content": None if message.get("content") is None else ""}))
        if message.get("reasoning_content") is not None:
            chunks.append(chunk({"reasoning_content": message["reasoning_content"]}))
        if message.get("content"):
            chunks.append(chunk({"content": message["content"]}))
        for k, call in enumerate(message.get("tool_calls") or []):
            chunks.append(chunk({"tool_calls": [{"index": k, **call}]}))
        chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append(base | {"choices": [], "usage": completion["usage"]})
    events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return events.encode()


def models_body(model_name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "rlhf_orch"}]}
