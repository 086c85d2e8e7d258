"""Rule-based (verifiable) rewards: the digit task, GSM8K as veRL scores it, math-verify, Countdown.

Each rule is built by `hydra.utils.instantiate` from the `reward` group, so constructors take plain
keyword arguments and validate them (ValueError naming the argument). The label of a prompt is the
ground truth in the dataset's layout (veRL's `reward_model.ground_truth`).
"""

from __future__ import annotations

import ast
import json
import numbers
import operator
import re
from typing import Any, Mapping, Optional

from rlhf_orch.data.base import Prompt
from rlhf_orch.data.digit_task import score_response
from rlhf_orch.reward.base import Response, RewardError, RewardFunction, check_number
from rlhf_orch.reward.options import CountdownRuleConfig, GSM8KRuleConfig


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
# veRL's scorer (verl/utils/reward_score/gsm8k.py, compute_score/extract_solution; checked against verl
# 0.9.1 and volcengine/verl@b178a3cd): only the last 300 characters are searched; strict takes the
# number after the last "#### " and drops its "," (a "$" cannot be inside the match); flexible takes the
# last run of digits/"."/"," with an optional "-" exactly as written, skipping runs that are only ".".
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300  # veRL: regexes on very long responses are slow and the answer comes last
_GSM8K_NOT_AN_ANSWER = ("", ".")  # veRL's `invalid_str` for flexible extraction


class GSM8KRule(RewardFunction):
    """GSM8K exactly as veRL's `gsm8k.compute_score` scores it (ReFT, Luong et al. 2024): `score` when
    the extracted answer equals the label, `format_score` when an answer was extracted but differs,
    0 when none was extracted.

    The response alone is veRL's `solution_str` (its reward manager decodes only the response). The
    comparison is of text, as in veRL: "18.0", "18." or (flexible) "1,000" do not equal the label "18" /
    "1000", and the label is used as written (a label "1,000" or "$18" never equals a strict answer).
    The one departure: a label given as a number is compared as its text (18 and 18.0 as "18"), where
    veRL, which compares against the raw ground truth, would never match a non-string label.
    """

    name = "gsm8k"
    METHODS = ("strict", "flexible")

    def __init__(
        self,
        method: str = GSM8KRuleConfig.method,
        format_score: float = GSM8KRuleConfig.format_score,
        score: float = GSM8KRuleConfig.score,
    ):
        if method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {method!r}")
        self.method = method
        self.format_score = check_number("format_score", format_score)
        self.correct_score = check_number("score", score)

    def extract(self, text: str) -> Optional[str]:
        """The answer text the response gives (veRL's `extract_solution`), or None when it gives none."""
        text = text[-_GSM8K_CLIP_CHARS:]
        if self.method == "strict":
            found = _GSM8K_STRICT.findall(text)
            return found[-1].replace(",", "") if found else None
        found = _GSM8K_FLEXIBLE.findall(text)
        if not found:
            return None
        # The last match that is not just "."; when every match is ".", veRL's loop variable is left at
        # the first match, so "." itself is the answer (a wrong one: `format_score`, not 0).
        return next((m for m in reversed(found) if m not in _GSM8K_NOT_AN_ANSWER), found[0])

    def score(self, prompt: Prompt, response: Response) -> float:
        label = _label_text(prompt.label, self.name)
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
# TinyZero's scorer (Jiayi-Pan/TinyZero verl/utils/reward_score/countdown.py @4d92412e, compute_score and
# the extract_solution / validate_equation / evaluate_equation it calls), re-implemented without `eval`.
_ASSISTANT_MARKERS = ("Assistant:", "<|im_start|>assistant")  # tried in this order, the first occurrence
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>")  # no DOTALL: a tag never spans lines
_EQUATION_CHARS = re.compile(r"^[\d+\-*/().\s]+$")  # TinyZero's allowed_pattern (\d, \s: any Unicode)
_COUNTDOWN_TOLERANCE = 1e-5
# An integer power whose result would exceed this many bits is refused (the equation scores
# `format_score`) instead of computed: TinyZero's eval would grind through `99 ** (98 * 97 * 96)` for
# hours. A power of 2**22 bits (~1.26 million digits) takes at most ~0.3 s on one core.
_MAX_POWER_BITS = 1 << 22


def countdown_answer(solution: str) -> Optional[str]:
    """The equation in the last <answer>...</answer> of the last line after the assistant's turn, stripped;
    None when there is none. TinyZero's `extract_solution`, step by step:

    - everything up to the first "Assistant:" is dropped, or, when the text has no "Assistant:", up to
      the first "<|im_start|>assistant"; a text with neither has no answer (the example tag in the
      prompt's user turn is never read);
    - only the last line ("\\n"-separated) is searched: a response that ends with a newline, or says
      anything on a line after its tag, has no answer;
    - of the tags on that line, the last one counts.
    """
    for marker in _ASSISTANT_MARKERS:
        if marker in solution:
            solution = solution.split(marker, 1)[1]
            break
    else:
        return None
    found = _ANSWER_TAG.findall(solution.split("\n")[-1])
    return found[-1].strip() if found else None


def uses_each_number_once(equation: str, given: list[int]) -> bool:
    """TinyZero's `validate_equation`: the digit runs of the equation, read as integers, are exactly the
    given numbers as a multiset ("2.5" reads as 2 and 5, "02" as 2, Unicode digits as their values)."""
    try:
        used = sorted(int(run) for run in re.findall(r"\d+", equation))
    except ValueError:  # a run beyond Python's int-from-text limit (4300 digits): TinyZero answers False
        return False
    return used == sorted(given)


class _NotArithmetic(ValueError):
    """Something eval would run but that is not arithmetic on numbers (a call, `()`, `...`)."""


class _TooLarge(ArithmeticError):
    """An integer power above _MAX_POWER_BITS."""


def _power(base: Any, exponent: Any) -> Any:
    if (
        type(base) is int
        and type(exponent) is int
        and abs(base) > 1
        and exponent * (abs(base).bit_length() - 1) > _MAX_POWER_BITS
    ):
        raise _TooLarge(f"{base} ** {exponent}")
    return operator.pow(base, exponent)


# Every operator the allowed characters can spell, with Python's semantics (int stays int, / is true
# division, // floor division, ** may give a float or a complex number).
_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: _power,
}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate_tree(root: ast.AST) -> Any:
    """Post-order evaluation with an explicit stack (an answer of 2,000 nested unary minus signs parses,
    and eval computes it; a recursive walk would not)."""
    values: list = []
    stack: list = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            values.append(node.value)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            if children_done:
                right = values.pop()
                values.append(_BINARY_OPS[type(node.op)](values.pop(), right))
            else:
                stack += [(node, True), (node.right, False), (node.left, False)]
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            if children_done:
                values.append(_UNARY_OPS[type(node.op)](values.pop()))
            else:
                stack += [(node, True), (node.operand, False)]
        else:
            raise _NotArithmetic(f"not arithmetic: {ast.dump(node)[:60]}")
    return values[0]


def evaluate_equation(equation: str) -> Any:
    """The value of the equation as TinyZero's `evaluate_equation` computes it (an int, float or complex
    number), or None where TinyZero's gives None.

    TinyZero checks the characters against `^[\\d+\\-*/().\\s]+$` and then calls `eval` with no builtins;
    here the same text is parsed by the same parser (`ast.parse`, so what is a syntax error there is one
    here) and the tree is computed by hand, with Python's own operators. Whatever those characters can
    spell besides numbers, + - * / // ** and signs (a call such as "(2)(3)", an empty tuple "()", "...")
    can only end in an error or a non-number in TinyZero, so it gives None here without being run.
    One deliberate difference: an integer power above 2**22 bits gives None instead of being computed.
    """
    if not _EQUATION_CHARS.match(equation):
        return None
    try:
        # eval drops leading spaces and tabs before parsing; ast.parse would call them an indent.
        tree = ast.parse(equation.lstrip(" \t"), mode="eval")
        return _evaluate_tree(tree.body)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError):
        return None


def _label_number(value: Any, what: str, *, integer: bool) -> Any:
    if isinstance(value, str):
        for parse in (int, float):
            try:
                value = parse(value)
                break
            except ValueError:
                continue
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not integer:
            return value
        if value.is_integer():
            return int(value)
    kind = "an integer" if integer else "a number"
    raise ValueError(f"countdown label: {what} must be {kind}, got {value!r}")


def _countdown_label(label: Any) -> tuple[Any, list[int]]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as exc:
            raise ValueError(f"countdown label is not JSON: {label[:80]!r}") from exc
    key = "numbers" if isinstance(label, Mapping) and "numbers" in label else "nums"
    if not isinstance(label, Mapping) or "target" not in label or key not in label:
        raise ValueError(f"countdown needs a label {{'target': int, 'numbers': [int, ...]}}, got {label!r}")
    target = _label_number(label["target"], "target", integer=False)
    return target, [_label_number(n, key, integer=True) for n in label[key]]


class CountdownRule(RewardFunction):
    """Countdown exactly as TinyZero's `countdown.compute_score` scores it (Pan et al. 2025): combine the
    given numbers, each exactly once, to hit the target. `score` when the answer's equation uses the
    numbers exactly once and its value is within 1e-5 of the target; `format_score` when there is an
    answer but it uses other numbers, cannot be evaluated, or misses; 0 when there is no answer.

    TinyZero's `solution_str` is the prompt and the response decoded together (its RewardManager decodes
    the prompt's and the response's token ids as one sequence), so the text scored here is `prompt.text +
    response.text`: the templated prompt (TinyZero's base template ends "Assistant: Let me solve this
    step by step.\\n<think>") followed by the response. The special tokens TinyZero's decode keeps (an EOS
    after the answer) never hold a newline or a tag, so skipping them changes nothing. As in TinyZero,
    a prompt template without "Assistant:" or "<|im_start|>assistant" makes every response score 0.

    The label is `{"target": number, "numbers": [int, ...]}` (TinyZero's ground truth; `"nums"`, the
    Countdown-Tasks-3to4 column our data options copy into the label, is read too), or that as a JSON
    string. Deliberate differences: equations are never `eval`-ed, and an integer power above 2**22 bits
    scores `format_score` instead of being computed (see `evaluate_equation`).
    """

    name = "countdown"

    def __init__(
        self, format_score: float = CountdownRuleConfig.format_score, score: float = CountdownRuleConfig.score
    ):
        self.format_score = check_number("format_score", format_score)
        self.correct_score = check_number("score", score)

    def score(self, prompt: Prompt, response: Response) -> float:
        target, numbers_given = _countdown_label(prompt.label)
        equation = countdown_answer(prompt.text + response.text)
        if equation is None:
            return 0.0
        if not uses_each_number_once(equation, numbers_given):
            return self.format_score
        value = evaluate_equation(equation)
        if value is None:
            return self.format_score
        try:
            hit = abs(value - target) < _COUNTDOWN_TOLERANCE  # NaN (inf - inf) misses, as in TinyZero
        except (ArithmeticError, TypeError):  # e.g. an int too large for a float target: TinyZero's except
            hit = False
        return self.correct_score if hit else self.format_score
