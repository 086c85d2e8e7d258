"""Rule-based (verifiable) rewards: the digit task, GSM8K as veRL scores it, math-verify, Countdown.

Each rule is built by `hydra.utils.instantiate` from the `reward` group, so constructors take plain
keyword arguments and validate them (ValueError naming the argument). The label of a prompt is the
ground truth in the dataset's layout (veRL's `reward_model.ground_truth`).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any, Mapping, Optional

from rlhf_orch.data.base import Prompt
from rlhf_orch.data.digit_task import score_response
from rlhf_orch.reward.base import Response, RewardError, RewardFunction, check_number


def _label_text(label: Any, rule: str) -> str:
    """A str/number label as text; ints stay ints ("18", not "18.0")."""
    if isinstance(label, str):
        return label
    if isinstance(label, bool) or label is None:
        raise ValueError(f"{rule} needs a string or number label, got {label!r}")
    if isinstance(label, int):
        return str(label)
    if isinstance(label, float):
        return str(int(label)) if label.is_integer() else repr(label)
    raise ValueError(f"{rule} needs a string or number label, got {type(label).__name__} {label!r}")


# ----------------------------------------------------------------------------- digit task
class DigitReverseRule(RewardFunction):
    """The embedded digit-reversal task: digits in place / max(answer, response) items.

    The label is the ideal answer text ("4 1 3"); the score is `digit_task.score_response`, the same
    function the built-in task trains with, so both paths give identical rewards.
    """

    name = "digit_reverse"

    def score(self, prompt: Prompt, response: Response) -> float:
        return score_response(_label_text(prompt.label, self.name), response.text)


# ----------------------------------------------------------------------------- GSM8K
# veRL (verl/utils/reward_score/gsm8k.py): strict wants "#### <number>", flexible the last number.
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
# veRL searches only the tail: regexes on very long responses are slow and the answer comes last.
_GSM8K_CLIP_CHARS = 300


def _gsm8k_normalize(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


class GSM8KRule(RewardFunction):
    """GSM8K with veRL's scorer semantics (ReFT, Luong et al. 2024): `score` for the right number,
    `format_score` for a wrong one that was found, 0 when none was found.

    Both the extracted answer and the label are compared as text after removing "," and "$"
    (veRL strips them from the extracted strict answer; doing it on both sides also accepts labels
    written "1,000" or "$18"). Flexible extraction skips matches that are only punctuation.
    """

    name = "gsm8k"
    METHODS = ("strict", "flexible")

    def __init__(self, method: str = "strict", format_score: float = 0.0, score: float = 1.0):
        if method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {method!r}")
        self.method = method
        self.format_score = check_number("format_score", format_score)
        self.correct_score = check_number("score", score)

    def extract(self, text: str) -> Optional[str]:
        """The answer the response gives (normalized), or None when it gives none."""
        text = text[-_GSM8K_CLIP_CHARS:]
        if self.method == "strict":
            found = _GSM8K_STRICT.findall(text)
            return _gsm8k_normalize(found[-1]) if found else None
        for candidate in reversed(_GSM8K_FLEXIBLE.findall(text)):
            candidate = _gsm8k_normalize(candidate)
            if candidate not in ("", "."):
                return candidate
        return None

    def score(self, prompt: Prompt, response: Response) -> float:
        label = _gsm8k_normalize(_label_text(prompt.label, self.name))
        answer = self.extract(response.text)
        if answer is None:
            return 0.0
        return self.correct_score if answer == label else self.format_score


# ----------------------------------------------------------------------------- math-verify
class MathVerifyRule(RewardFunction):
    """MATH-style answers checked by Hugging Face's math-verify: 1.0 when the response's final answer
    is mathematically equal to the label (\\boxed{}, LaTeX, plain numbers, fractions, sets), else 0.0.

    math-verify's own timeouts use `signal.alarm` (they fail outside the main thread and would clobber
    the per-sample timer of execution.py), so they are turned off here; `timeout_s` is a per-sample
    limit that execution.py enforces instead (the smaller of it and `reward.timeout_s`).
    """

    name = "math_verify"

    def __init__(self, timeout_s: Optional[float] = None):
        if timeout_s is not None:
            timeout_s = check_number("timeout_s", timeout_s)
            if timeout_s <= 0:
                raise ValueError(f"timeout_s must be > 0 or null, got {timeout_s!r}")
        self.timeout_s = timeout_s

    def check(self) -> None:
        """Import math-verify (and sympy, ~1 s) before the per-sample timer starts."""
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:
            raise RewardError(
                "reward=math_verify needs the math-verify package: pip install 'math-verify[antlr4_9_3]' "
                "(the antlr4 4.9 runtime that hydra/omegaconf also need)"
            ) from exc

    @staticmethod
    def _parse(text: str) -> list:
        from math_verify import parse  # heavy (sympy): imported where scoring happens

        return parse(text, parsing_timeout=None, raise_on_error=False)

    def parse_label(self, label: Any) -> list:
        """The gold answer; plain labels ("3/4", "x^2+1") are tried as math and as a boxed answer."""
        text = _label_text(label, self.name).strip()
        if not text:
            raise ValueError("math_verify got an empty label")
        if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
            candidates = [text]
        else:
            candidates = [f"${text}$", f"\\boxed{{{text}}}", text]
        for candidate in candidates:
            gold = self._parse(candidate)
            if gold:
                return gold
        raise ValueError(f"math_verify cannot parse the label {text!r}")

    def score(self, prompt: Prompt, response: Response) -> float:
        from math_verify import verify

        gold = self.parse_label(prompt.label)
        answer = self._parse(response.text)
        if not answer:
            return 0.0
        return 1.0 if verify(gold, answer, timeout_seconds=None, raise_on_error=False) else 0.0


# ----------------------------------------------------------------------------- Countdown
# TinyZero (verl/utils/reward_score/countdown.py): the response ends with <answer>equation</answer>.
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>")
_EQUATION_CHARS = re.compile(r"^[\d+\-*/().\s]+$")
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def countdown_answer(text: str) -> Optional[str]:
    """The content of the last <answer>...</answer> (stripped), or None.

    As in TinyZero, anything before "Assistant:" / "<|im_start|>assistant" is dropped (a prompt echoed
    in front must not provide the answer); unlike TinyZero, a response with neither marker is read
    whole (our responses never include the prompt) and the tag may be on any line, not only the last.
    """
    if "Assistant:" in text:
        text = text.split("Assistant:", 1)[1]
    elif "<|im_start|>assistant" in text:
        text = text.split("<|im_start|>assistant", 1)[1]
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        return _BINARY_OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    raise ValueError(f"not allowed in a countdown equation: {ast.dump(node)[:60]}")


def evaluate_equation(equation: str) -> Optional[float]:
    """The value of an arithmetic equation, or None when it is not one or cannot be evaluated.

    Never `eval`: only digits, + - * / ( ) . and spaces pass the character check, and the parsed tree
    may hold only numbers, + - * / and unary signs. `**` passes TinyZero's character check but is
    refused here (not a countdown operation, and `9**9**9` would hang the scorer).
    """
    if not _EQUATION_CHARS.match(equation):
        return None
    try:
        return float(_eval_node(ast.parse(equation.strip(), mode="eval")))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError, MemoryError, TypeError):
        return None


def _countdown_label(label: Any) -> tuple[float, list[int]]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as exc:
            raise ValueError(f"countdown label is not JSON: {label[:80]!r}") from exc
    if not isinstance(label, Mapping) or "target" not in label or "numbers" not in label:
        raise ValueError(f"countdown needs a label {{'target': int, 'numbers': [int, ...]}}, got {label!r}")
    return float(label["target"]), sorted(int(n) for n in label["numbers"])


class CountdownRule(RewardFunction):
    """Countdown (TinyZero, Pan et al. 2025): combine `numbers`, each exactly once, with + - * / to hit
    `target`. `score` for a correct equation, `format_score` for an answer tag holding a wrong or
    invalid equation, 0 without an answer tag.

    The label is `{"target": int, "numbers": [int, ...]}` or that as a JSON string.
    """

    name = "countdown"

    def __init__(self, format_score: float = 0.1, score: float = 1.0):
        self.format_score = check_number("format_score", format_score)
        self.correct_score = check_number("score", score)

    def score(self, prompt: Prompt, response: Response) -> float:
        target, numbers = _countdown_label(prompt.label)
        equation = countdown_answer(response.text)
        if equation is None:
            return 0.0
        # Every given number exactly once (TinyZero: the integers in the text as a multiset).
        used = re.findall(r"\d+", equation)
        if any(len(n) > 64 for n in used) or sorted(int(n) for n in used) != numbers:
            return self.format_score
        value = evaluate_equation(equation)
        if value is None or abs(value - target) >= 1e-5:
            return self.format_score
        return self.correct_score
