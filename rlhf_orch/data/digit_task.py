"""The embedded verifiable task: reverse a short string of digits.

A prompt reads ``rev 3 1 4 =`` and the ideal response is ``4 1 3`` followed by EOS. Every piece is a
separate space-delimited word, so the tiny model's tokenizer (rlhf_orch.models.tiny) maps each word
to exactly one token: a prompt with d digits is 1 (BOS) + 1 (``rev``) + d + 1 (``=``) tokens, plus
``filler_tokens`` filler words in front for the long-context variant.

The task is a `PromptSource` like any dataset: prompts carry the answer as their `label` and the
source name ``digit_reverse``, and the reward is the rule `rlhf_orch.reward.rules.DigitReverseRule`
(``reward=digit_reverse``), a pure function of the label and the response text (``score_response``).
"""

from __future__ import annotations

import dataclasses

import re
from typing import Any, Sequence

import numpy as np

from rlhf_orch.data.base import ALL_PROMPTS, Prompt, PromptSource
from rlhf_orch.data.options import DigitTaskConfig

# Words the task uses; the tiny tokenizer must hold each as one token.
DIGIT_WORDS: tuple[str, ...] = tuple(str(d) for d in range(10))
INSTRUCTION_WORD = "rev"
ANSWER_MARKER = "="
# Filler words are drawn at random (not one repeated word) so long prompts are not trivially
# compressible by prefix caching and look like real context to the engines.
FILLER_WORDS: tuple[str, ...] = ("a", "b", "c", "d", "f", "g", "h", "k")

# Bumped whenever the prompt format or the reward changes, so models warm-started on the old task
# are rebuilt (the tiny model's cache key includes it).
TASK_FORMAT_VERSION = 1

# A response is read as a sequence of items: each digit is one item, each run of other
# non-space characters is one junk item ("rev", "=", "<eos>" leaking as text, ...).
_RESPONSE_ITEM = re.compile(r"\d|[^\d\s]+")


SOURCE = "digit_reverse"


def score_response(answer: str, response_text: str) -> float:
    """Partial credit in [0, 1]: answer digits in the right position / max(answer, response) length.

    Dividing by the longer of the two makes extra items (more digits, junk words, or a missing EOS
    that lets the policy ramble on) cost credit, so the unique optimum is the exact answer.
    """
    target = answer.split()
    items = _RESPONSE_ITEM.findall(response_text)
    if not target or not items:
        return 0.0
    in_place = sum(1 for want, got in zip(target, items) if want == got)
    return in_place / max(len(target), len(items))


def reward_fn(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """Batch reward: pure and picklable, so it can be shipped to a Ray task as is."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return [score_response(p.label, r) for p, r in zip(prompts, responses)]


class DigitReverseTask(PromptSource):
    """Prompt source of the digit-reversal task: an endless seeded stream, plus a held-out set."""

    # Separate random streams, so the warm-start corpus never replays the PPO prompt sequence and
    # evaluation prompts are never trained on (up to chance collisions of short digit strings).
    _PROMPT_STREAM = 1
    _CORPUS_STREAM = 2
    _EVAL_STREAM = 3
    _TAIL_STREAM = 4  # which prompts must be answered at length (its own stream: the prompts stay the same)

    def __init__(
        self,
        prompt_max_len: int,
        response_max_len: int,
        seed: int,
        min_digits: int,
        max_digits: int,
        filler_tokens: int,
        eval_size: int = DigitTaskConfig.eval_size,
        long_tail_frac: float = DigitTaskConfig.long_tail_frac,
        long_tail_len: int = DigitTaskConfig.long_tail_len,
    ) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if filler_tokens < 0:
            raise ValueError(f"filler_tokens must be >= 0, got {filler_tokens}")
        self.prompt_max_len = prompt_max_len
        self.response_max_len = response_max_len
        self.seed = seed
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.filler_tokens = filler_tokens
        if eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {eval_size}")
        self.eval_size = eval_size
        # The long tail of reasoning rollouts: this fraction of training prompts must be answered
        # with at least long_tail_len tokens (the rest end where the model puts EOS).
        if not 0.0 <= long_tail_frac <= 1.0 or long_tail_len < 0 or long_tail_len > response_max_len:
            raise ValueError(
                f"need 0 <= long_tail_frac <= 1 and 0 <= long_tail_len <= response_max_len, got {long_tail_frac}, {long_tail_len}"
            )
        self.long_tail_frac = long_tail_frac
        self.long_tail_len = long_tail_len
        self._batches_drawn = 0  # the sampler's whole state: batch k is a pure function of (seed, k)
        self._tokenizer: Any = None
        if self.max_prompt_tokens > prompt_max_len:
            raise ValueError(
                f"prompts take up to {self.max_prompt_tokens} tokens (BOS + {filler_tokens} filler "
                f"+ rev + {max_digits} digits + =) but prompt_max_len is {prompt_max_len}"
            )
        if self.max_response_tokens > response_max_len:
            raise ValueError(
                f"the answer takes up to {self.max_response_tokens} tokens ({max_digits} digits + "
                f"EOS) but response_max_len is {response_max_len}"
            )

    # ----------------------------------------------------------------- sizes (tiny tokenizer)
    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in tokens of the tiny tokenizer, BOS included."""
        return 1 + self.filler_tokens + 1 + self.max_digits + 1

    @property
    def max_response_tokens(self) -> int:
        """Longest ideal response in tokens, EOS included."""
        return self.max_digits + 1

    # ----------------------------------------------------------------- PromptSource
    def bind(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def num_train_prompts(self) -> None:
        return None  # an endless generator

    def sample_prompts(self, n: int) -> list[Prompt]:
        """The next `n` training prompts (batch number `batches drawn + 1`)."""
        self._batches_drawn += 1
        return self._tokenized(self.batch(n, self._batches_drawn))

    def eval_prompts(self, limit: int = ALL_PROMPTS) -> list[Prompt]:
        """The held-out set: `eval_size` prompts of their own stream, in a fixed order."""
        rng = np.random.default_rng([self.seed, self._EVAL_STREAM])
        prompts = [self._draw(rng) for _ in range(self.eval_size)]
        return self._tokenized(prompts[:limit] if limit else prompts)

    def state_dict(self) -> dict[str, int]:
        return {"batches_drawn": self._batches_drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._batches_drawn = int(state["batches_drawn"])

    def _tokenized(self, prompts: list[Prompt]) -> list[Prompt]:
        if self._tokenizer is None:
            return prompts
        tok = self._tokenizer
        return [dataclasses.replace(p, prompt_ids=tuple(tok(p.text).input_ids)) for p in prompts]

    # ----------------------------------------------------------------- sampling (pure)
    def batch(self, n: int, index: int) -> list[Prompt]:
        """Batch number `index` of `n` prompts: the same (seed, index, n) always gives the same list."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, self._PROMPT_STREAM, index])
        prompts = [self._draw(rng) for _ in range(n)]
        if self.long_tail_frac and self.long_tail_len:
            tail = np.random.default_rng([self.seed, self._TAIL_STREAM, index]).random(n) < self.long_tail_frac
            prompts = [
                dataclasses.replace(p, min_response_len=self.long_tail_len) if t else p for p, t in zip(prompts, tail)
            ]
        return prompts

    def corpus(self, n: int) -> list[str]:
        """`n` solved examples (prompt + " " + answer), for tokenizer training and the warm start."""
        rng = np.random.default_rng([self.seed, self._CORPUS_STREAM])
        return [self.solved_text(self._draw(rng)) for _ in range(n)]

    @staticmethod
    def solved_text(prompt: Prompt) -> str:
        """The prompt followed by its ideal response (the EOS is the tokenizer's business)."""
        return f"{prompt.text} {prompt.label}"

    @staticmethod
    def vocabulary_words() -> tuple[str, ...]:
        """Every word a prompt or answer can contain; a tokenizer for the task needs all of them."""
        return DIGIT_WORDS + (INSTRUCTION_WORD, ANSWER_MARKER) + FILLER_WORDS

    def _draw(self, rng: np.random.Generator) -> Prompt:
        length = int(rng.integers(self.min_digits, self.max_digits + 1))
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, size=length))
        words: list[str] = []
        if self.filler_tokens:
            picks = rng.integers(0, len(FILLER_WORDS), size=self.filler_tokens)
            words.extend(FILLER_WORDS[int(i)] for i in picks)
        words.append(INSTRUCTION_WORD)
        words.extend(digits)
        words.append(ANSWER_MARKER)
        return Prompt(text=" ".join(words), label=" ".join(reversed(digits)), source=SOURCE, extra={"digits": digits})

    def definition(self) -> dict[str, int]:
        """What identifies the task (for cache keys of models trained on it)."""
        return {
            "format_version": TASK_FORMAT_VERSION,
            "prompt_max_len": self.prompt_max_len,
            "response_max_len": self.response_max_len,
            "seed": self.seed,
            "min_digits": self.min_digits,
            "max_digits": self.max_digits,
            "filler_tokens": self.filler_tokens,
        }
