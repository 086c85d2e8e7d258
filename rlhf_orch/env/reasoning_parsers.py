"""A turn's reasoning apart from its answer (`env.reasoning_parser`, the agent endpoint): vLLM's own
reasoning parsers (`vllm.reasoning`: `qwen3`, `deepseek_r1`, ...) split `<think>...</think>` into
the message's `reasoning_content`, as vLLM's OpenAI server does; `none` leaves the text whole."""

from __future__ import annotations

import threading
from typing import Any

from rlhf_orch.env.base import EnvError
from rlhf_orch.env.tool_parsers import chat_request

NONE = "none"
_PARSERS: dict[tuple[str, int], Any] = {}
_LOCK = threading.Lock()  # parsers are shared by the endpoint's threads; calls are serialised


def check_reasoning_parser(key: str, name: str) -> None:
    if name == NONE:
        return
    try:
        from vllm.reasoning import ReasoningParserManager
    except ImportError:  # no vLLM on this host: the engines build it before their first call
        return
    known = sorted(ReasoningParserManager.list_registered())
    if name not in known:
        raise EnvError(f"{key}={name!r}: must be none or a vLLM reasoning parser ({', '.join(known)})")


def reasoning_parser(parser: str, tokenizer: Any) -> Any:
    """The (cached) vLLM reasoning parser; EnvError when it cannot work with this tokenizer."""
    from vllm.reasoning import ReasoningParserManager

    with _LOCK:
        key = (parser, id(tokenizer))
        if key not in _PARSERS:
            try:
                _PARSERS[key] = ReasoningParserManager.get_reasoning_parser(parser)(tokenizer)
            except (RuntimeError, KeyError, ValueError) as e:
                raise EnvError(
                    f"env.reasoning_parser={parser!r} cannot parse this model's turns: {type(e).__name__}: {e}"
                ) from e
        return _PARSERS[key]


def split_reasoning(text: str, parser: str, tokenizer: Any) -> tuple[str | None, str | None]:
    """(reasoning, content) of a completion's text."""
    if parser == NONE:
        return None, text
    shared = reasoning_parser(parser, tokenizer)
    request = chat_request()
    with _LOCK:
        return shared.extract_reasoning(text, request)
