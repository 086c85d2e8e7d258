"""Tool calls out of a model turn, in the format the model was trained to write them.

`hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Qwen2.5, Hermes) is read here;
every other format is read by vLLM's own tool parsers (`vllm.tool_parsers`, the ones vLLM's OpenAI
server uses: `llama3_json`, `mistral`, `qwen3_coder`, `qwen3_xml`, `pythonic`, ...), given the
engine's tokenizer and the tools offered; one parser per tokenizer and tools list, used under a lock
(vLLM's server builds one per request). `none` reads no calls.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rlhf_orch.env.base import EnvError

HERMES, NONE = "hermes", "none"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: Any = None  # the decoded JSON arguments (a dict for well-formed calls)
    error: str | None = None  # what is wrong with the call (not JSON, no name)


def vllm_tool_parsers() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def check_tool_parser(key: str, name: str, built_in: Sequence[str]) -> None:
    """EnvError naming `key` when `name` is neither built in nor one of vLLM's tool parsers."""
    if name in built_in:
        return
    try:
        known = vllm_tool_parsers()
    except ImportError:  # no vLLM on this host: the engines check it before their first turn (ensure_tool_parser)
        return
    if name not in known:
        raise EnvError(
            f"{key}={name!r}: must be one of {', '.join(built_in)} or a vLLM tool parser ({', '.join(known)})"
        )


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):  # some models (and every vLLM parser) send the arguments JSON-encoded
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, None, f"tool call is not JSON: {e.msg} at column {e.colno}"))
            continue
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, None, 'a tool call needs a "name"'))
            continue
        calls.append(ToolCall(call["name"], _arguments(call.get("arguments", {}))))
    content = _HERMES.sub("", text).strip() if calls else text
    return content or None, calls


class _Shared:
    """One vLLM parser for a (parser, tokenizer, tools) triple, used under a lock: newer parsers keep
    state between calls (qwen3_coder keeps the last request's tools), and turns are parsed from many
    threads at once (the endpoint's, the environment step pool's). Building one per call costs
    30-225 ms."""

    def __init__(self, parser: Any):
        self.parser = parser
        self.lock = threading.Lock()


_PARSERS: dict[tuple[str, int, str], _Shared] = {}
_PARSERS_LOCK = threading.Lock()


def chat_request(tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
    """The request object vLLM's output parsers read (the tools offered; nothing else matters to them)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model="policy", messages=[{"role": "user", "content": ""}], tools=list(tools) if tools else None
    )


def vllm_parser(parser: str, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> _Shared:
    """The (cached) vLLM tool parser for this tokenizer and these tools; EnvError naming the key's
    value when it cannot work with the tokenizer (its marker tokens missing, no complete-text parsing)."""
    from vllm.tool_parsers import ToolParserManager

    key = (parser, id(tokenizer), json.dumps(tools, sort_keys=True, default=str))
    with _PARSERS_LOCK:
        if key not in _PARSERS:
            try:
                shared = _Shared(ToolParserManager.get_tool_parser(parser)(tokenizer))
                shared.parser.extract_tool_calls("", chat_request(tools))
            except (RuntimeError, NotImplementedError, KeyError, ValueError) as e:
                raise EnvError(
                    f"tool parser {parser!r} cannot parse this model's turns: {type(e).__name__}: {e}"
                ) from e
            _PARSERS[key] = shared
        return _PARSERS[key]


def _vllm(
    text: str, parser: str, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[str | None, list[ToolCall]]:
    shared = vllm_parser(parser, tokenizer, tools)
    with shared.lock:
        info = shared.parser.extract_tool_calls(text, chat_request(tools))
    if not info.tools_called:
        return text, []
    return info.content, [ToolCall(c.function.name, _arguments(c.function.arguments)) for c in info.tool_calls]


def ensure_tool_parser(parser: str, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Where the turns are parsed (an engine), before the first one: the parser works with this tokenizer."""
    if parser not in (HERMES, NONE, "tags"):
        vllm_parser(parser, tokenizer, tools)


def extract_tool_calls(
    text: str, parser: str, tokenizer: Any = None, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(the turn's content without its calls, the calls) of a model turn's text."""
    if parser == NONE:
        return text, []
    if parser == HERMES:
        return _hermes(text)
    if tokenizer is None:
        raise ValueError(f"the {parser!r} tool parser needs the engine's tokenizer")
    return _vllm(text, parser, tokenizer, tools)
