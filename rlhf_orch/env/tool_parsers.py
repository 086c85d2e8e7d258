"""Tool calls out of a model turn, in the format the model was trained to write them.

`hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Qwen2.5, Hermes) is read here;
every other format is read by vLLM's own tool parsers (`vllm.tool_parsers`, the ones vLLM's OpenAI
server uses: `llama3_json`, `mistral`, `qwen3_coder`, `qwen3_xml`, `pythonic`, ...), given the
engine's tokenizer and the tools offered. `none` reads no calls.
"""

from __future__ import annotations

import json
import re
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
    except ImportError:  # no vLLM on this host: the engines check it where they run
        return
    if name not in known:
        raise EnvError(f"{key}={name!r}: must be one of {', '.join(built_in)} or a vLLM tool parser ({', '.join(known)})")


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
            calls.append(ToolCall(None, None, "a tool call needs a \"name\""))
            continue
        calls.append(ToolCall(call["name"], _arguments(call.get("arguments", {}))))
    content = _HERMES.sub("", text).strip() if calls else text
    return content or None, calls


_PARSERS: dict[tuple[str, int], Any] = {}


def _vllm(text: str, parser: str, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str | None, list[ToolCall]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    key = (parser, id(tokenizer))
    if key not in _PARSERS:  # one per parser and tokenizer (they precompute token ids)
        _PARSERS[key] = ToolParserManager.get_tool_parser(parser)(tokenizer)
    request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}], tools=list(tools) if tools else None)
    info = _PARSERS[key].extract_tool_calls(text, request)
    if not info.tools_called:
        return text, []
    return info.content, [ToolCall(c.function.name, _arguments(c.function.arguments)) for c in info.tool_calls]


def extract_tool_calls(text: str, parser: str, tokenizer: Any = None,
                       tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(the turn's content without its calls, the calls) of a model turn's text."""
    if parser == NONE:
        return text, []
    if parser == HERMES:
        return _hermes(text)
    if tokenizer is None:
        raise ValueError(f"the {parser!r} tool parser needs the engine's tokenizer")
    return _vllm(text, parser, tokenizer, tools)
