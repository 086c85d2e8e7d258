"""The embedded tool-use task: the answer is a record's value, which only a lookup tool returns.

A prompt reads ``find 3 1 4 =``: record 3 1 4 holds a value (random digits drawn with the prompt,
carried as its label), which the policy cannot know from the prompt. A trajectory that solves it:

    find 3 1 4 =  call<eos>  got 9 0 5 =  9 0 5<eos>
    (prompt)      (turn 1)   (the tool)   (turn 2: the value)

The lookup tool is `env=lookup` (`rlhf_orch.env.lookup`); answering without calling it scores
chance (a tenth of a digit per position). The tiny tool model (`model=tiny_tool`) is warm-started
on such trajectories with noise -- half of its demonstrations answer without the tool, and copied
digits are often wrong -- so tool calls occur from the first step and RL has room to sharpen both.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rlhf_orch.data.base import Prompt
from rlhf_orch.data.digit_task import ANSWER_MARKER, DIGIT_WORDS, DigitReverseTask

FIND_WORD = "find"
CALL_WORD = "call"  # the whole tool call: a turn that is this word asks the tool
RESULT_WORD = "got"  # starts the tool's answer
SOURCE = "lookup_tool"
LOOKUP_FORMAT_VERSION = 1


def tool_answer(value: str) -> str:
    """What the lookup tool returns for a record holding `value` (appended as plain text)."""
    return f" {RESULT_WORD} {value} {ANSWER_MARKER}"


class LookupTask(DigitReverseTask):
    """Prompt source of the lookup task (the digit task's sampler, streams and held-out set)."""

    direct_fraction = 0.5  # noisy warm-start demonstrations that answer without the tool

    @property
    def max_response_tokens(self) -> int:
        """The ideal trajectory: call + EOS, the tool's answer, the value + EOS."""
        return 2 + (2 + self.max_digits) + self.max_digits + 1

    @staticmethod
    def vocabulary_words() -> tuple[str, ...]:
        return DIGIT_WORDS + (FIND_WORD, ANSWER_MARKER, CALL_WORD, RESULT_WORD)

    @staticmethod
    def solved_text(prompt: Prompt) -> str:
        return f"{prompt.text} {CALL_WORD}{tool_answer(prompt.label)} {prompt.label}"

    def _draw(self, rng: np.random.Generator) -> Prompt:
        length = int(rng.integers(self.min_digits, self.max_digits + 1))
        record = " ".join(str(int(d)) for d in rng.integers(0, 10, size=length))
        value = " ".join(str(int(d)) for d in rng.integers(0, 10, size=length))
        return Prompt(
            text=f"{FIND_WORD} {record} {ANSWER_MARKER}", label=value, source=SOURCE, extra={"record": record}
        )

    def definition(self) -> dict[str, Any]:
        return {
            **super().definition(),
            "task": SOURCE,
            "lookup_format_version": LOOKUP_FORMAT_VERSION,
            "direct_fraction": self.direct_fraction,
        }

    # ----------------------------------------------------------------- the warm start's demonstrations
    def warm_start_examples(
        self, texts: Sequence[str], tokenizer: Any, noise: float, seed: int
    ) -> tuple[list[list[int]], list[list[bool]]]:
        """Token ids of each demonstration and which of them are trained on (the model's turns;
        the prompt and the tool's answer are context). With `noise` > 0, `direct_fraction` of
        them answer at once with random digits, and copied digits are replaced w.p. `noise`."""
        rng = np.random.default_rng(seed)
        eos = tokenizer.eos_token_id
        sequences, trained = [], []
        for text in texts:
            prompt_text, rest = text.split(f" {CALL_WORD} ", 1)
            value = rest.split(f" {ANSWER_MARKER} ", 1)[1]
            digits = value.split()
            prompt = tokenizer(prompt_text).input_ids
            if noise > 0 and rng.random() < self.direct_fraction:
                guess = " ".join(str(int(d)) for d in rng.integers(0, 10, size=len(digits)))
                answer = tokenizer(guess, add_special_tokens=False).input_ids + [eos]
                sequences.append(prompt + answer)
                trained.append([False] * len(prompt) + [True] * len(answer))
                continue
            call = tokenizer(CALL_WORD, add_special_tokens=False).input_ids + [eos]
            observation = tokenizer(tool_answer(value), add_special_tokens=False).input_ids
            copied = [d if rng.random() >= noise else str(int(rng.integers(0, 10))) for d in digits]
            answer = tokenizer(" ".join(copied), add_special_tokens=False).input_ids + [eos]
            sequences.append(prompt + call + observation + answer)
            trained.append(
                [False] * len(prompt) + [True] * len(call) + [False] * len(observation) + [True] * len(answer)
            )
        return sequences, trained
