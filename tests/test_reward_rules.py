"""Rule rewards against hand-computed scores (veRL's GSM8K, math-verify, TinyZero's Countdown, the digit task)."""

from __future__ import annotations

import pickle
import threading

import pytest

from rlhf_orch.data.digit_task import score_response
from rlhf_orch.reward.base import Response
from rlhf_orch.reward.rules import CountdownRule, DigitReverseRule, GSM8KRule, MathVerifyRule, evaluate_equation

from rlhf_orch.data.base import Prompt


def _score(rule, label, text: str) -> float:
    response = Response(text=text, num_tokens=len(text.split()), truncated=False)
    return rule.score(Prompt(text="q", label=label), response)


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
@pytest.mark.parametrize(
    "method, label, text, expected",
    [
        ("strict", "1234", "Adding up gives 1,234.\n#### 1,234", 1.0),  # commas removed
        ("strict", "7", "#### 5\nwait, I made an error\n#### 7", 1.0),  # the last "####" counts
        ("strict", "13", "so the answer is\n#### 12", 0.1),  # found but wrong: format_score
        ("strict", "13", "The answer is 13", 0.0),  # no "####": nothing found
        ("strict", "-5", "The temperature fell to\n#### -5", 1.0),
        ("strict", "$18", "She earns 9 * 2 = 18 dollars.\n#### 18", 1.0),  # "$" in the label
        ("strict", "18", "#### $18", 0.0),  # veRL's regex needs a digit right after "#### "
        ("flexible", "42", "First 3, then 5, finally 42", 1.0),  # the last number
        ("flexible", "5", "First 3, then 5, finally 42", 0.1),
        ("flexible", "-12", "The change is -12", 1.0),
        ("flexible", "1000", "It costs $1,000", 1.0),
        ("flexible", "7", "3 + 4 = 7.", 0.1),  # "7." != "7": veRL compares the matched text
        ("flexible", "1", "Done.", 0.0),  # a lone "." is not a number
        ("flexible", "1", "no digits here", 0.0),
    ],
)
def test_gsm8k(method, label, text, expected):
    assert _score(GSM8KRule(method=method, format_score=0.1), label, text) == pytest.approx(expected)


def test_gsm8k_searches_only_the_last_300_characters():
    rule = GSM8KRule()
    assert _score(rule, "5", "#### 5" + " and some words" * 19) == 1.0  # 291 characters: all inside
    assert _score(rule, "5", "#### 5" + " and some words" * 20) == 0.0  # 306: "#### 5" is cut off
    assert _score(GSM8KRule(method="flexible"), 5, "x" * 400 + "so 5") == 1.0  # an int label


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
LABEL = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    "label, text, expected",
    [
        (LABEL, "<think>2*3=6, 6*4=24</think>\n<answer>2 * 3 * 4</answer>", 1.0),
        (LABEL, "<answer>(2 + 4) * 4</answer>", 0.1),  # 4 used twice, 3 unused
        (LABEL, "<answer>6 * 4</answer>", 0.1),  # a number missing (6 is not given)
        (LABEL, "<answer>2 + 3 + 4</answer>", 0.1),  # valid but 9
        (LABEL, "<answer>2.5 * 4 + 3</answer>", 0.1),  # a non-integer: its digits are not the numbers
        (LABEL, "The answer is 2 * 3 * 4", 0.0),  # no tag
        (LABEL, "<answer>2+3+4</answer> no wait <answer>2*3*4</answer>", 1.0),  # the last tag
        ('{"target": 24, "numbers": [2, 3, 4]}', "<answer>4*3*2</answer>", 1.0),  # a JSON label
        ({"target": 24, "numbers": [3, 3, 8, 8]}, "<answer>8 / (3 - 8 / 3)</answer>", 1.0),  # 24.000000000000004
        ({"target": 1, "numbers": [5, 5, 7]}, "<answer>7 / (5 - 5)</answer>", 0.1),  # division by zero
        ({"target": 8, "numbers": [2, 3]}, "<answer>2 ** 3</answer>", 0.1),  # not a countdown operation
        # TinyZero drops what precedes the assistant's turn: a tag echoed from the prompt does not count.
        (LABEL, "User: e.g. <answer>2*3*4</answer> Assistant: it is <answer>2+3+4</answer>", 0.1),
        (LABEL, "User: e.g. <answer>2*3*4</answer> Assistant: no idea", 0.0),
    ],
)
def test_countdown(label, text, expected):
    assert _score(CountdownRule(), label, text) == pytest.approx(expected)


def test_countdown_never_executes_the_answer(tmp_path):
    marker = tmp_path / "pwned"
    text = f"<answer>__import__('os').system('touch {marker}')</answer>"
    assert _score(CountdownRule(format_score=0.25), LABEL, text) == 0.25
    label = {"target": 0, "numbers": [1]}
    assert _score(CountdownRule(), label, "<answer>(lambda: 1)()</answer>") == 0.1
    assert not marker.exists()
    assert evaluate_equation("[1][0]") is None
    assert evaluate_equation("9**9**9") is None  # passes the character check, refused by the tree walk
    assert evaluate_equation("(1 + 2) * 3 / 4") == pytest.approx(2.25)


def test_countdown_bad_label_raises():
    with pytest.raises(ValueError, match="countdown"):
        _score(CountdownRule(), {"target": 3}, "<answer>1+2</answer>")
    with pytest.raises(ValueError, match="format_score"):
        CountdownRule(format_score=None)


def test_rules_pickle():
    for rule in (DigitReverseRule(), GSM8KRule("flexible", 0.2, 2.0), MathVerifyRule(), CountdownRule()):
        clone = pickle.loads(pickle.dumps(rule))
        assert type(clone) is type(rule) and clone.__dict__ == rule.__dict__ and clone.name == rule.name
    assert _score(pickle.loads(pickle.dumps(GSM8KRule("flexible", 0.2, 2.0))), "3", "x 3") == 2.0
