"""Rule rewards: veRL's GSM8K and TinyZero's Countdown against scores their own code gives, math-verify and
the digit task against hand-computed scores.

Where the GSM8K and Countdown expectations come from: every literal expected score in `test_gsm8k_as_verl` and
`test_countdown_as_tinyzero` was printed by running the peers' real functions, in a throwaway venv, on exactly
these inputs: veRL 0.9.1 (`pip install --no-deps verl`; verl/utils/reward_score/gsm8k.py, identical to
volcengine/verl@b178a3cd) `compute_score(text, label, method=..., format_score=0.1, score=1.0)`, and
Jiayi-Pan/TinyZero verl/utils/reward_score/countdown.py (last changed in 4d92412e) `compute_score(prompt +
response, label, format_score=0.1, score=1.0)`, both on Python 3.11. Integer 0s are the peers' own `return 0`.
Tests named `..._deliberate_...` pin the few places where we differ on purpose (docs/algorithms.md).
"""

from __future__ import annotations

import json
import pickle
import threading
import time

import numpy as np
import pytest

from rlhf_orch.data.digit_task import score_response
from rlhf_orch.data.base import Prompt
from rlhf_orch.reward.base import Response
from rlhf_orch.reward.rules import (
    CountdownRule,
    DigitReverseRule,
    GSM8KRule,
    MathVerifyRule,
    countdown_answer,
    evaluate_equation,
)


def _score(rule, label, text: str, prompt: str = "q") -> float:
    response = Response(text=text, num_tokens=len(text.split()), truncated=False)
    return rule.score(Prompt(text=prompt, label=label), response)


# ----------------------------------------------------------------------------- digit task
@pytest.mark.parametrize(
    "answer, text, expected",
    [
        ("4 1 3", "4 1 3", 1.0),
        ("4 1 3", "4 1", 2 / 3),
        ("4 1 3", "4 1 3 x", 3 / 4),  # a junk item costs credit
        ("4 1 3", "3 1 4", 1 / 3),
        ("4 1 3", "", 0.0),
    ],
)
def test_digit_rule_is_score_response(answer, text, expected):
    assert _score(DigitReverseRule(), answer, text) == pytest.approx(expected)
    assert _score(DigitReverseRule(), answer, text) == score_response(answer, text)


# ----------------------------------------------------------------------------- GSM8K
# Expected scores: veRL's gsm8k.compute_score (see the module docstring). The response alone is veRL's
# solution_str (its reward manager decodes only the response).
@pytest.mark.parametrize(
    "method, label, text, expected",
    [
        pytest.param("strict", "1234", "Adding up gives 1,234.\n#### 1,234", 1.0, id="strict-commas"),
        pytest.param("strict", "1000000", "#### 1,000,000", 1.0, id="strict-commas-million"),
        pytest.param("strict", "1,234", "#### 1,234", 0.1, id="strict-comma-label"),
        pytest.param("strict", "18", "#### $18", 0, id="strict-dollar-after-hashes"),
        pytest.param("strict", "$18", "She earns 9 * 2 = 18 dollars.\n#### 18", 0.1, id="strict-dollar-label"),
        pytest.param("strict", "18", "#### 18.", 0.1, id="strict-trailing-period"),
        pytest.param("strict", "18", "#### 18.0", 0.1, id="strict-decimal-zero"),
        pytest.param("strict", "1000.5", "#### 1,000.50", 0.1, id="strict-decimal-cents"),
        pytest.param("strict", "-5", "The temperature fell to\n#### -5", 1.0, id="strict-negative"),
        pytest.param("strict", "-5", "#### --5", 0, id="strict-double-minus"),
        pytest.param("strict", "5", "####  5", 0, id="strict-two-spaces"),
        pytest.param("strict", "5", "####5", 0, id="strict-no-space"),
        pytest.param("strict", "7", "#### 5\nwait, I made an error\n#### 7", 1.0, id="strict-last-hashes-right"),
        pytest.param("strict", "7", "#### 7\nno, actually\n#### 5", 0.1, id="strict-last-hashes-wrong"),
        pytest.param("strict", "13", "so the answer is\n#### 12", 0.1, id="strict-wrong"),
        pytest.param("strict", "13", "The answer is 13", 0, id="strict-no-hashes"),
        pytest.param("strict", "42", "#### 42 is what I get, after 3 checks.", 1.0, id="strict-answer-mid-text"),
        pytest.param("strict", "5", "#### ,5", 1.0, id="strict-leading-comma"),
        pytest.param("strict", "5", "#### 5-3", 1.0, id="strict-subtraction-after"),
        pytest.param("strict", "42", "#### \u0664\u0662", 0, id="strict-arabic-digits"),
        pytest.param("strict", "0", "", 0, id="strict-empty"),
        pytest.param("strict", " 18", "#### 18", 0.1, id="strict-label-whitespace"),
        pytest.param("strict", "5", "#### 5" + "x" * 294, 1.0, id="strict-300-chars-kept"),
        pytest.param("strict", "5", "#### 5" + "x" * 295, 0, id="strict-301-chars-cut"),
        pytest.param("strict", "5", "#### 4\n" + "y" * 1000 + "\n#### 5", 1.0, id="strict-long-answer-at-end"),
        pytest.param("flexible", "42", "First 3, then 5, finally 42", 1.0, id="flex-last-number"),
        pytest.param("flexible", "5", "First 3, then 5, finally 42", 0.1, id="flex-not-last-number"),
        pytest.param("flexible", "-12", "The change is -12", 1.0, id="flex-negative"),
        pytest.param("flexible", "-12", "The change is - 12", 0.1, id="flex-spaced-minus"),
        pytest.param("flexible", "1000", "It costs $1,000", 0.1, id="flex-dollar-comma"),
        pytest.param("flexible", "1,000", "It costs $1,000", 1.0, id="flex-dollar-comma-label"),
        pytest.param("flexible", "-5", "a loss of $-5", 1.0, id="flex-dollar-negative"),
        pytest.param("flexible", "7", "3 + 4 = 7.", 0.1, id="flex-trailing-period"),
        pytest.param("flexible", "42", "The answer is 42 .", 1.0, id="flex-spaced-period"),
        pytest.param("flexible", "42", "The answer is 42, right.", 0.1, id="flex-trailing-comma"),
        pytest.param("flexible", "18", "It is 18.00", 0.1, id="flex-decimal-zero"),
        pytest.param("flexible", "1", "Done.", 0.1, id="flex-lone-period"),
        pytest.param("flexible", "1", ".", 0.1, id="flex-only-period"),
        pytest.param("flexible", "1", "Hello, world", 0.1, id="flex-lone-comma"),
        pytest.param("flexible", "1", "Well, .", 0.1, id="flex-comma-then-period"),
        pytest.param("flexible", "8", "5 apples, 3 pears, total 8 fruits, ...", 0.1, id="flex-ellipsis"),
        pytest.param("flexible", "2", "pages 1-2", 0.1, id="flex-range"),
        pytest.param("flexible", "1", "no digits here", 0, id="flex-no-digits"),
        pytest.param("flexible", "72", "#### 72\n\nI hope this helps!", 1.0, id="flex-hashes-then-words"),
        pytest.param("flexible", "5", "x" * 400 + "so 5", 1.0, id="flex-long-prefix"),
        pytest.param("flexible", "345", "12345" + "x" * 297, 1.0, id="flex-number-cut-by-clip"),
        pytest.param("flexible", "12345", "12345" + "x" * 297, 0.1, id="flex-number-cut-by-clip-full-label"),
        pytest.param("flexible", "0", "", 0, id="flex-empty"),
    ],
)
def test_gsm8k_as_verl(method, label, text, expected):
    assert _score(GSM8KRule(method=method, format_score=0.1), label, text) == expected


# Expected scores: veRL's gsm8k.compute_score with these format_score / score.
@pytest.mark.parametrize(
    "method, format_score, score, label, text, expected",
    [
        ("strict", 0.0, 1.0, "12", "#### 13", 0.0),
        ("strict", 0.0, 1.0, "13", "#### 13", 1.0),
        ("strict", 0.0, 1.0, "13", "no answer", 0),
        ("flexible", 0.25, 2.0, "3", "x 3", 2.0),
        ("flexible", 0.25, 2.0, "4", "x 3", 0.25),
        ("flexible", 0.25, 2.0, "4", "x", 0),
        ("flexible", -1.0, 1.0, "4", "Done.", -1.0),
    ],
)
def test_gsm8k_scores_as_verl(method, format_score, score, label, text, expected):
    assert _score(GSM8KRule(method, format_score, score), label, text) == expected
    assert GSM8KRule().method == "strict" and GSM8KRule().format_score == 0.0  # veRL's defaults


def test_gsm8k_deliberate_number_labels():
    """A label given as a number is compared as its text; veRL compares against the raw ground truth,
    so with 18 (not "18") it would give format_score (0.1 here) to the right answer."""
    rule = GSM8KRule(format_score=0.1)
    assert _score(rule, 18, "#### 18") == 1.0
    assert _score(rule, 18.0, "#### 18") == 1.0
    assert _score(rule, 18.5, "#### 18.5") == 1.0
    assert _score(GSM8KRule(method="flexible"), 5, "x" * 400 + "so 5") == 1.0
    with pytest.raises(ValueError, match="gsm8k"):
        _score(rule, None, "#### 18")


def test_gsm8k_validates_its_arguments():
    with pytest.raises(ValueError, match="method"):
        GSM8KRule(method="loose")
    with pytest.raises(ValueError, match="format_score"):
        GSM8KRule(format_score="a")
    with pytest.raises(ValueError, match="score"):
        GSM8KRule(score=float("nan"))


# ----------------------------------------------------------------------------- math-verify
@pytest.mark.parametrize(
    "label, text, expected",
    [
        ("0.5", r"So the result is $\boxed{\frac{1}{2}}$.", 1.0),
        ("1/2", r"So the result is $\boxed{\frac{1}{2}}$.", 1.0),
        (r"\frac{1}{2}", r"The answer is \boxed{0.5}", 1.0),
        ("3/4", r"The answer is \boxed{\frac{3}{4}}", 1.0),
        ("1/2", r"So the result is $\boxed{\frac{1}{3}}$.", 0.0),
        ("1/2", "I do not know.", 0.0),
    ],
)
def test_math_verify(label, text, expected):
    assert _score(MathVerifyRule(), label, text) == expected


def test_math_verify_runs_off_the_main_thread():
    """math-verify's own signal timeouts would raise ValueError here; they must be off."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(_score(MathVerifyRule(), "1/2", r"\boxed{0.5}")))
    worker.start()
    worker.join(30)
    assert out == [1.0]


def test_math_verify_validates_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyRule(timeout_s=0)
    assert MathVerifyRule(timeout_s=3).timeout_s == 3.0


# ----------------------------------------------------------------------------- Countdown
# TinyZero's solution_str is the prompt and the response decoded together, so the rule scores prompt.text +
# response.text; BASE is TinyZero's base template (our data=countdown_tinyzero prompt), QWEN its qwen-instruct one.
BASE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer.\nUser: Using the "
    "numbers [2, 3, 4], create an equation that equals 24. You can use basic arithmetic operations (+, -, *, /) and each "
    "number can only be used once. Show your work in <think> </think> tags. And return the final answer in <answer> "
    "</answer> tags, for example <answer> (1 + 2) / 3 </answer>.\nAssistant: Let me solve this step by step.\n<think>"
)
QWEN = (
    "<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process in the mind and then "
    "provides the user with the answer.<|im_end|>\n<|im_start|>user\n Using the numbers [2, 3, 4], create an equation "
    "that equals 24. You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. Show "
    "your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, for example <answer> "
    "(1 + 2) / 3 </answer>.<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
)
LABEL = {"target": 24, "numbers": [2, 3, 4]}
BIG = "1" + "0" * 309 + ".0"  # a float literal that is inf


# Expected scores: TinyZero's countdown.compute_score(prompt + response, label) (see the module docstring).
@pytest.mark.parametrize(
    "prompt, label, text, expected",
    [
        pytest.param(BASE, LABEL, "2*3=6, 6*4=24</think>\n<answer>2 * 3 * 4</answer>", 1.0, id="right"),
        pytest.param(QWEN, LABEL, "2*3=6, 6*4=24</think>\n<answer>2 * 3 * 4</answer>", 1.0, id="right-qwen-marker"),
        pytest.param(BASE, LABEL, "</think>\n<answer>   (4*3) * 2 </answer>", 1.0, id="right-spaces-inside-tag"),
        pytest.param(
            BASE, LABEL, "</think>\n<answer>2*3*4</answer> is my answer", 1.0, id="right-text-after-tag-same-line"
        ),
        pytest.param(BASE, LABEL, "</think>\n<answer>(2 + 4) * 4</answer>", 0.1, id="number-reused"),
        pytest.param(BASE, LABEL, "</think>\n<answer>6 * 4</answer>", 0.1, id="number-missing"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4 * 1</answer>", 0.1, id="number-extra"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 + 3 + 4</answer>", 0.1, id="wrong-result"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2.0 * 3 * 4</answer>", 0.1, id="decimal-point-splits-numbers"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4 = 24</answer>", 0.1, id="equals-sign"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 x 3 x 4</answer>", 0.1, id="disallowed-x"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 \u00d7 3 \u00d7 4</answer>", 0.1, id="disallowed-unicode-times"),
        pytest.param(BASE, LABEL, "</think>\n<answer>\u0662 * 3 * 4</answer>", 0.1, id="arabic-digit"),
        pytest.param(BASE, LABEL, "</think>\n<answer>02 * 3 * 4</answer>", 0.1, id="leading-zero"),
        pytest.param(
            BASE,
            {"target": -24, "numbers": [2, 3, 4]},
            "</think>\n<answer>-2 * 3 * 4</answer>",
            1.0,
            id="negative-target",
        ),
        pytest.param(BASE, {"target": 8, "numbers": [2, 3]}, "</think>\n<answer>2 ** 3</answer>", 1.0, id="power"),
        pytest.param(
            BASE, {"target": 3, "numbers": [7, 2]}, "</think>\n<answer>7 // 2</answer>", 1.0, id="floor-division"
        ),
        pytest.param(
            BASE,
            {"target": 1, "numbers": [5, 5, 7]},
            "</think>\n<answer>7 / (5 - 5)</answer>",
            0.1,
            id="division-by-zero",
        ),
        pytest.param(
            BASE,
            {"target": 24, "numbers": [3, 3, 8, 8]},
            "</think>\n<answer>8 / (3 - 8 / 3)</answer>",
            1.0,
            id="float-result-exact-enough",
        ),
        pytest.param(
            BASE,
            {"target": 1, "numbers": [1000000, 999999]},
            "</think>\n<answer>1000000 / 999999</answer>",
            1.0,
            id="float-within-1e-5",
        ),
        pytest.param(
            BASE,
            {"target": 1, "numbers": [100000, 99999]},
            "</think>\n<answer>100000 / 99999</answer>",
            0.1,
            id="float-just-outside-1e-5",
        ),
        pytest.param(
            BASE, {"target": 2.5, "numbers": [5, 2]}, "</think>\n<answer>5 / 2</answer>", 1.0, id="float-target"
        ),
        pytest.param(
            BASE,
            {"target": 0, "numbers": [10**309, 0, 10**309, 0]},
            "</think>\n<answer>" + BIG + " - " + BIG + "</answer>",
            0.1,
            id="inf-minus-inf-is-nan",
        ),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4 + ()</answer>", 0.1, id="empty-tuple"),
        pytest.param(BASE, LABEL, "</think>\n<answer>(2)(3) * 4</answer>", 0.1, id="call-a-number"),
        pytest.param(BASE, LABEL, "</think>\nThe answer is 2 * 3 * 4", 0, id="no-tag"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4", 0, id="unclosed-tag"),
        pytest.param(BASE, LABEL, "</think>\n<answer></answer>", 0.1, id="empty-tag"),
        pytest.param(
            BASE, LABEL, "</think>\n<answer>2+3+4</answer> no wait <answer>2*3*4</answer>", 1.0, id="last-tag-right"
        ),
        pytest.param(
            BASE, LABEL, "</think>\n<answer>2*3*4</answer> no wait <answer>2+3+4</answer>", 0.1, id="last-tag-wrong"
        ),
        pytest.param(BASE, LABEL, "</think>\n<answer>2*3*4</answer><answer></answer>", 0.1, id="last-tag-empty"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2*3*4</answer>\nThat is all.", 0, id="tag-not-on-last-line"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2*3*4</answer>\n", 0, id="trailing-newline"),
        pytest.param(BASE, LABEL, "</think>\r\n<answer>2*3*4</answer>\r\n", 0, id="crlf-line-end"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2*3*4</answer>\r", 1.0, id="carriage-return-only"),
        pytest.param(BASE, LABEL, "</think>\n<answer>\n2*3*4\n</answer>", 0, id="tag-spans-lines"),
        pytest.param(BASE, LABEL, "2*3*4 works</think> <answer>2*3*4</answer>", 1.0, id="one-line-response"),
        pytest.param(BASE, {"target": 1, "numbers": [1, 2, 3]}, "no idea", 0, id="prompt-example-not-an-answer"),
        pytest.param("", LABEL, "<answer>2*3*4</answer>", 0, id="no-marker-empty-prompt"),
        pytest.param("Solve it.", LABEL, "</think>\n<answer>2*3*4</answer>", 0, id="no-marker-plain-prompt"),
        pytest.param("", LABEL, "Assistant: <answer>2*3*4</answer>", 1.0, id="marker-in-response"),
        pytest.param("", LABEL, "assistant: <answer>2*3*4</answer>", 0, id="lowercase-marker"),
        pytest.param("", LABEL, "<|im_start|>assistant\n<answer>2*3*4</answer>", 1.0, id="im-start-marker-in-response"),
        pytest.param(
            BASE,
            {"target": 2**100, "numbers": [2, 100]},
            "</think>\n<answer>2 ** 100</answer>",
            1.0,
            id="power-big-int-exact",
        ),
        pytest.param(
            BASE,
            {"target": 0.25, "numbers": [2, 2]},
            "</think>\n<answer>2 ** -2</answer>",
            1.0,
            id="power-negative-exponent",
        ),
        pytest.param(
            BASE,
            {"target": 0.5, "numbers": [10, 400]},
            "</think>\n<answer>10 ** 400</answer>",
            0.1,
            id="huge-int-against-float-target",
        ),
        pytest.param(
            BASE,
            {"target": 10, "numbers": [10, 400, 10, 399]},
            "</think>\n<answer>10 ** 400 / 10 ** 399</answer>",
            1.0,
            id="huge-int-division",
        ),
        pytest.param(
            BASE,
            {"target": 10, "numbers": [10, 400, 1]},
            "</think>\n<answer>10 ** 400 * 1.</answer>",
            0.1,
            id="huge-int-to-float-overflow",
        ),
        pytest.param(
            BASE,
            {"target": -4, "numbers": [4, 1, 2, 2]},
            "</think>\n<answer>((-4) ** (1 / 2)) ** 2</answer>",
            1.0,
            id="complex-intermediate-hits",
        ),
        pytest.param(
            BASE,
            {"target": 2, "numbers": [8, 1, 3]},
            "</think>\n<answer>(-8) ** (1 / 3)</answer>",
            0.1,
            id="complex-result-misses",
        ),
        pytest.param(
            BASE,
            {"target": 2, "numbers": [8, 1, 3, 1]},
            "</think>\n<answer>(-8) ** (1 / 3) // 1</answer>",
            0.1,
            id="complex-floor-division",
        ),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 *\x0c3 * 4</answer>", 1.0, id="form-feed-inside"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 *\r3 * 4</answer>", 0.1, id="carriage-return-inside"),
        pytest.param(BASE, LABEL, "</think>\n<answer>(2 *\r3 * 4)</answer>", 1.0, id="carriage-return-in-parens"),
        pytest.param(
            BASE,
            {"target": 24, "numbers": [24]},
            "</think>\n<answer>" + "--" * 500 + "24</answer>",
            1.0,
            id="deep-unary-minus",
        ),
        pytest.param(
            BASE,
            {"target": 24, "numbers": [24]},
            "</think>\n<answer>" + "(" * 300 + "24" + ")" * 300 + "</answer>",
            0.1,
            id="too-many-parentheses",
        ),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4 * ...</answer>", 0.1, id="ellipsis"),
        pytest.param(BASE, LABEL, "</think>\n<answer>2 * 3 * 4 *</answer>", 0.1, id="trailing-operator"),
        pytest.param(
            BASE,
            {"target": 24, "numbers": [24, 1]},
            "</think>\n<answer>24. * 1.</answer>",
            1.0,
            id="float-literal-forms",
        ),
    ],
)
def test_countdown_as_tinyzero(prompt, label, text, expected):
    assert _score(CountdownRule(), label, text, prompt=prompt) == expected


def test_countdown_answer_extraction():
    assert countdown_answer(BASE + "</think>\n<answer> 2*3*4 </answer>") == "2*3*4"
    assert countdown_answer(BASE + "no idea") is None  # the prompt's example tag is before "Assistant:"
    assert countdown_answer("<answer>2*3*4</answer>") is None  # no assistant marker
    # "Assistant:" wins over "<|im_start|>assistant" wherever each is, and the first occurrence counts.
    assert countdown_answer("<|im_start|>assistant <answer>1</answer> Assistant: <answer>2</answer>") == "2"
    assert countdown_answer("Assistant: <answer>1</answer> Assistant: x") == "1"


def test_countdown_scores_and_defaults():
    rule = CountdownRule(format_score=0.25, score=2.0)
    assert _score(rule, LABEL, "</think>\n<answer>2*3*4</answer>", prompt=BASE) == 2.0
    assert _score(rule, LABEL, "</think>\n<answer>2+3+4</answer>", prompt=BASE) == 0.25
    assert _score(rule, LABEL, "</think>\nno tag", prompt=BASE) == 0.0
    assert (CountdownRule().format_score, CountdownRule().correct_score) == (0.1, 1.0)  # TinyZero's defaults


def test_countdown_label_layouts():
    text = "</think>\n<answer>4*3*2</answer>"
    assert _score(CountdownRule(), json.dumps(LABEL), text, prompt=BASE) == 1.0  # a JSON string
    # Our countdown data options copy the Countdown-Tasks-3to4 columns: {"target", "nums"}, nums from parquet.
    assert _score(CountdownRule(), {"target": 24, "nums": np.array([2, 3, 4])}, text, prompt=BASE) == 1.0
    assert _score(CountdownRule(), {"target": np.int64(24), "nums": [2.0, "3", 4]}, text, prompt=BASE) == 1.0
    assert _score(CountdownRule(), {"target": "24", "numbers": [2, 3, 4]}, text, prompt=BASE) == 1.0
    with pytest.raises(ValueError, match="countdown"):
        _score(CountdownRule(), {"target": 3}, text, prompt=BASE)
    with pytest.raises(ValueError, match="countdown"):
        _score(CountdownRule(), {"target": 24, "numbers": [2.5, 3, 4]}, text, prompt=BASE)
    with pytest.raises(ValueError, match="countdown"):
        _score(CountdownRule(), "not json", text, prompt=BASE)
    with pytest.raises(ValueError, match="format_score"):
        CountdownRule(format_score=None)


def test_countdown_never_executes_the_answer(tmp_path):
    marker = tmp_path / "pwned"
    for code in (f"__import__('os').system('touch {marker}')", "(lambda: 1)()", "[1][0]"):
        assert evaluate_equation(code) is None
        assert (
            _score(CountdownRule(format_score=0.25), LABEL, f"</think>\n<answer>{code}</answer>", prompt=BASE) == 0.25
        )
    assert not marker.exists()
    assert evaluate_equation("(1 + 2) * 3 / 4") == 2.25
    assert evaluate_equation("7 // 2") == 3 and evaluate_equation("2 ** 3") == 8 and evaluate_equation(" 2") == 2
    assert evaluate_equation("99 ** (98 * 97)") == 99 ** (98 * 97)  # large but computed, as eval would
    assert evaluate_equation("7 / 8 ** 25 ** 4") == 0.0  # 8 ** 390625: 1.2 million bits, computed


def test_countdown_deliberate_huge_powers_are_refused():
    """An integer power above 2**22 bits is refused and the answer scores format_score. TinyZero's eval would spend
    hours on 9 ** 9 ** 9 and then score "9 ** 9 ** 9 * 0 * 9" as a hit on 0 (1.0 rather than the 0.1 here)."""
    start = time.monotonic()
    assert evaluate_equation("9 ** 9 ** 9") is None
    assert evaluate_equation("99 ** (98 * 97 * 96)") is None
    label = {"target": 0, "numbers": [9, 9, 9, 0, 9]}
    assert _score(CountdownRule(), label, "</think>\n<answer>9 ** 9 ** 9 * 0 * 9</answer>", prompt=BASE) == 0.1
    assert time.monotonic() - start < 5


def test_rules_pickle():
    for rule in (DigitReverseRule(), GSM8KRule("flexible", 0.2, 2.0), MathVerifyRule(), CountdownRule()):
        clone = pickle.loads(pickle.dumps(rule))
        assert type(clone) is type(rule) and clone.__dict__ == rule.__dict__ and clone.name == rule.name
    assert _score(pickle.loads(pickle.dumps(GSM8KRule("flexible", 0.2, 2.0))), "3", "x 3") == 2.0
