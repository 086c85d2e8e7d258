"""Observation messages -> token ids, appended after the model's tokens (never re-tokenising them).

`chat_template`: the tokenizer's chat template renders the new messages only: render a fixed
conversation with and without them (generation prompt on) and keep the difference -- the way a
chat model sees a tool result or a user reply in a conversation. `plain`: the messages' contents,
tokenised as text without special tokens (models whose template renders no tool or user turns,
like the tiny test model).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rlhf_orch.env.base import EnvError

# The fixed conversation the new messages are rendered after (its own tokens are dropped).
_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
FORMATS = ("chat_template", "plain")


class ObservationRenderer:
    def __init__(self, tokenizer: Any, fmt: str):
        if fmt not in FORMATS:
            raise EnvError(f"env.observation_format={fmt!r}: must be one of {', '.join(FORMATS)}")
        self.tokenizer = tokenizer
        self.format = fmt
        self._base: list[int] | None = None

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return [int(t) for t in out]

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A whole prompt an environment rewrote in `init`: the chat template with the generation
        prompt (as `data.chat_template=true` renders rows)."""
        return self._render(messages, generation_prompt=True)

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if not messages:
            return []
        if self.format == "plain":
            text = "".join(str(m.get("content", "")) for m in messages)
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self._base is None:
            self._base = self._render(_BASE, generation_prompt=False)
        full = self._render([*_BASE, *messages], generation_prompt=True)
        if full[: len(self._base)] != self._base:
            raise EnvError(
                "env.observation_format=chat_template: this tokenizer's chat template does not render a "
                "conversation as a prefix of its continuation; use env.observation_format=plain"
            )
        new = full[len(self._base):]
        if not new and any(str(m.get("content", "")) for m in messages):
            raise EnvError(
                "env.observation_format=chat_template: this tokenizer's chat template renders none of the "
                f"roles {sorted({str(m.get('role')) for m in messages})}; use env.observation_format=plain"
            )
        return new
