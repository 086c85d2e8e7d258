"""A user's veRL-style reward file: signatures, results, load errors with file and line, caching, pickling."""

from __future__ import annotations

import pickle
import re
import textwrap

import pytest

from rlhf_orch.reward.base import Response, RewardError
from rlhf_orch.reward.custom import CustomReward, describe_exception

from rlhf_orch.data.base import Prompt


PROMPTS = [
    Prompt(text="q1", label="7", source="gsm8k", extra={"split": "train", "index": 0}),
    Prompt(text="q2", label="8", source="math", extra=None),
]
RESPONSES = [
    Response(text="#### 7", num_tokens=3, truncated=False),
    Response(text="nine", num_tokens=1, truncated=True),
]


def _write(tmp_path, body: str, filename: str = "my_reward.py") -> str:
    path = tmp_path / filename
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_verl_four_argument_signature(tmp_path):
    path = _write(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            split = extra_info["split"] if extra_info else "none"
            return {"gsm8k": 1.0, "math": 10.0}[data_source] + (solution_str.endswith(ground_truth)) + len(split)
        """,
    )
    fn = CustomReward(path, "compute_score")
    fn.check()
    assert fn.name == "compute_score" and fn.needs_label is False and fn.batched is False
    # gsm8k: 1 + True + len("train"); math: 10 + False + len("none")
    assert fn.score_batch(PROMPTS, RESPONSES) == [7.0, 14.0]


def test_three_arguments_and_default_extra_info(tmp_path):
    path = _write(
        tmp_path,
        """
        def three(data_source, solution_str, ground_truth):
            return float(solution_str == "#### " + ground_truth)

        def with_default(data_source, solution_str, ground_truth, extra_info=None):
            return -1.0 if extra_info is None else float(extra_info["index"])

        def only_text(solution_str, bonus=0.5):  # veRL passes by name; unknown optional ones keep defaults
            return len(solution_str) + bonus
        """,
    )
    assert CustomReward(path, "three").score_batch(PROMPTS, RESPONSES) == [1.0, 0.0]
    assert CustomReward(path, "with_default").score_batch(PROMPTS, RESPONSES) == [0.0, -1.0]
    assert CustomReward(path, "only_text").score_batch(PROMPTS, RESPONSES) == [6.5, 4.5]


def test_dict_result_is_read_as_its_score(tmp_path):
    path = _write(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 0.25, "acc": True, "pred": solution_str}
        """,
    )
    assert CustomReward(path, "compute_score").score(PROMPTS[0], RESPONSES[0]) == 0.25


def test_batched_form(tmp_path):
    calls = tmp_path / "calls.txt"
    path = _write(
        tmp_path,
        f"""
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            with open({str(calls)!r}, "a") as f:
                f.write(f"{{len(solution_strs)}}\\n")
            pairs = zip(data_sources, solution_strs)
            return [{{"score": float(len(s))}} if src == "gsm8k" else 2.0 for src, s in pairs]

        def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
            return [1.0]
        """,
    )
    fn = CustomReward(path, "compute_score", batched=True)
    assert fn.batched is True
    assert fn.score_batch(PROMPTS, RESPONSES) == [6.0, 2.0]
    assert calls.read_text() == "2\n"  # one call for the whole batch
    assert fn.score(PROMPTS[1], RESPONSES[1]) == 2.0  # a single sample is a batch of one
    with pytest.raises(RewardError, match="must return a list of 2 scores, got 1 values"):
        CustomReward(path, "wrong_length", batched=True).score_batch(PROMPTS, RESPONSES)


def test_missing_file(tmp_path):
    with pytest.raises(RewardError, match=r"reward\.path: no such file .*nope\.py"):
        CustomReward(str(tmp_path / "nope.py"), "compute_score").check()


def test_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "x = 1\n\ndef compute_score(data_source, solution_str:\n    return 1\n")
    with pytest.raises(RewardError) as info:
        CustomReward(path, "compute_score").check()
    message = str(info.value)
    assert f"{path}:3: SyntaxError" in message and "\n" not in message


def test_import_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "import os\n\nTABLE = {}\nWEIGHT = TABLE['missing']\n")
    with pytest.raises(RewardError, match=re.escape(f"{path}:4: KeyError: 'missing'")):
        CustomReward(path, "compute_score").check()


def test_missing_name_lists_the_callables(tmp_path):
    path = _write(
        tmp_path,
        """
        import math
        from os.path import join

        THRESHOLD = 0.5
        scorer = 3

        def my_score(data_source, solution_str, ground_truth):
            return 1.0

        class Grader:
            pass

        def _private():
            pass
        """,
    )
    with pytest.raises(RewardError) as info:
        CustomReward(path, "compute_score").check()
    message = str(info.value)
    assert "defines no 'compute_score'" in message
    assert message.endswith("callables it defines: Grader, my_score")  # not the imports, not _private
    with pytest.raises(RewardError, match="non-callable 'scorer'"):
        CustomReward(path, "scorer").check()


def test_unknown_required_parameter(tmp_path):
    path = _write(tmp_path, "def compute_score(prompt, response):\n    return 1.0\n")
    with pytest.raises(RewardError, match="parameter 'prompt' is not one veRL passes"):
        CustomReward(path, "compute_score").check()


def test_error_at_scoring_points_into_the_user_file(tmp_path):
    path = _write(
        tmp_path,
        """
        def helper(text):
            return int(text)

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return helper(solution_str) / 2
        """,
    )
    fn = CustomReward(path, "compute_score")
    with pytest.raises(ValueError) as info:
        fn.score(PROMPTS[1], RESPONSES[1])
    # the innermost frame inside the user's file: helper's line
    expected = f"{path}:3: ValueError: invalid literal for int() with base 10: 'nine'"
    assert describe_exception(info.value, path) == expected
    assert fn.describe_error(info.value) == describe_exception(info.value, path)
    assert describe_exception(RuntimeError("elsewhere"), path) == f"{path}: RuntimeError: elsewhere"


def test_constructor_validates():
    with pytest.raises(ValueError, match=r"reward\.path"):
        CustomReward("", "compute_score")
    with pytest.raises(ValueError, match=r"reward\.name"):
        CustomReward("x.py", "")
    with pytest.raises(ValueError, match=r"reward\.batched"):
        CustomReward("x.py", "f", batched="yes")


def test_pickles_as_path_name_batched_and_loads_once(tmp_path, monkeypatch):
    counter = tmp_path / "imports.txt"
    path = _write(
        tmp_path,
        f"""
        with open({str(counter)!r}, "a") as f:
            f.write("imported\\n")

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.5
        """,
    )
    monkeypatch.chdir(tmp_path)
    fn = CustomReward("my_reward.py", "compute_score")  # relative: resolved in the constructor
    assert not counter.exists()  # lazy: nothing imported before first use
    blob = pickle.dumps(fn)
    assert len(blob) < 300  # only (path, name, batched), never the module
    clone = pickle.loads(blob)
    assert vars(clone) == {"path": path, "name": "compute_score", "batched": False}
    assert clone.score(PROMPTS[0], RESPONSES[0]) == 0.5
    assert fn.score(PROMPTS[0], RESPONSES[0]) == 0.5
    CustomReward(path, "compute_score").check()
    assert counter.read_text() == "imported\n"  # executed once in this process
