"""The digit-reversal task: reward rule, deterministic prompts, lengths in the tiny tokenizer."""

from __future__ import annotations

import pickle

import pytest

from rlhf_orch.data.digit_task import DigitReverseTask, Prompt, reward_fn, score_response
from rlhf_orch.models.tiny_build import train_tokenizer


def default_task(**overrides: int) -> DigitReverseTask:
    kwargs = dict(prompt_max_len=32, response_max_len=16, seed=1234, min_digits=3, max_digits=5, filler_tokens=0)
    kwargs.update(overrides)
    return DigitReverseTask(**kwargs)


def long_task() -> DigitReverseTask:  # conf/data/long8k.yaml
    return default_task(prompt_max_len=1024, response_max_len=7168, filler_tokens=960)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(default_task(), vocab_size=64, corpus_size=500)


# ----------------------------------------------------------------------------- reward
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("4 1 3", 1.0),  # exact
        (" 4 1 3", 1.0),  # leading space, as vLLM's detokenizer returns it
        ("413", 1.0),  # digits are read one by one, spacing does not matter
        ("", 0.0),  # empty
        ("   ", 0.0),
        ("4 1 9", 2 / 3),  # one digit wrong
        ("4 1", 2 / 3),  # stopped one digit early
        ("3 1 4", 1 / 3),  # the prompt copied, not reversed: only the middle digit in place
        ("1 3", 0.0),  # right digits, wrong positions
        ("4 1 3 3", 3 / 4),  # an extra digit costs credit
        ("4 1 3 rev", 3 / 4),  # junk after the answer costs credit
        ("4 1 3 = = =", 3 / 6),
        ("rev 4 1 3", 0.0),  # junk first shifts every digit out of place
        ("rev =", 0.0),
    ],
)
def test_reward_hand_checked(response: str, expected: float) -> None:
    assert score_response("4 1 3", response) == pytest.approx(expected)


def test_reward_optimum_is_exact_answer() -> None:
    answer = "7 0 8 9 0"
    candidates = ["7 0 8 9", "7 0 8 9 0 0", "7 0 8 9 0 x", "7 0 8 9 1", "7 0 8 9 0"]
    scores = {c: score_response(answer, c) for c in candidates}
    assert max(scores, key=scores.get) == answer
    assert all(s < 1.0 for c, s in scores.items() if c != answer)


def test_task_reward_uses_prompt_answer() -> None:
    task = default_task()
    prompt = task.sample_prompts(1, step=0)[0]
    assert task.reward(prompt, prompt.answer) == 1.0
    assert task.reward(prompt, "") == 0.0
    assert 0.0 <= task.reward(prompt, "x 1 y 2 z 3 w 4 5 6 7 8 9 0 1 2") <= 1.0


def test_reward_fn_is_picklable_and_batched() -> None:
    task = default_task()
    prompts = task.sample_prompts(3, step=5)
    fn, shipped = pickle.loads(pickle.dumps((reward_fn, prompts)))
    assert fn(shipped, [p.answer for p in shipped]) == [1.0, 1.0, 1.0]
    assert fn(shipped, ["", "", ""]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        fn(shipped, [""])


# ----------------------------------------------------------------------------- prompts
def test_prompt_format() -> None:
    prompt = default_task().sample_prompts(1, step=0)[0]
    words = prompt.text.split()
    assert words[0] == "rev" and words[-1] == "="
    assert "".join(words[1:-1]) == prompt.digits
    assert prompt.answer == " ".join(reversed(prompt.digits))
    assert 3 <= len(prompt.digits) <= 5


def test_sample_prompts_deterministic_in_seed_and_step() -> None:
    task = default_task()
    assert task.sample_prompts(32, step=3) == default_task().sample_prompts(32, step=3)
    assert task.sample_prompts(32, step=3) != task.sample_prompts(32, step=4)
    assert task.sample_prompts(32, step=3) != default_task(seed=99).sample_prompts(32, step=3)
    lengths = {len(p.digits) for p in task.sample_prompts(200, step=0)}
    assert lengths == {3, 4, 5}


def test_corpus_is_solved_prompts() -> None:
    task = default_task()
    corpus = task.corpus(50)
    assert corpus == task.corpus(50)
    for text in corpus:
        prompt_part, answer_part = text.split(" = ")
        digits = prompt_part.split()[1:]
        assert answer_part.split() == digits[::-1]


def test_filler_prefix_length() -> None:
    task = long_task()
    for prompt in task.sample_prompts(4, step=0):
        words = prompt.text.split()
        assert words.index("rev") == 960
        assert set(words[:960]) <= set(DigitReverseTask.vocabulary_words())
    assert task.sample_prompts(2, step=1) == long_task().sample_prompts(2, step=1)


# ----------------------------------------------------------------------------- token lengths
@pytest.mark.parametrize("make_task", [default_task, long_task], ids=["default", "long8k"])
def test_prompts_fit_prompt_max_len(tokenizer, make_task) -> None:
    task = make_task()
    for prompt in task.sample_prompts(64, step=0):
        ids = tokenizer(prompt.text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        # One token per word plus BOS: the count the task's own length check relies on.
        assert len(ids) == len(prompt.text.split()) + 1
        assert len(ids) <= task.prompt_max_len
        answer_ids = tokenizer(prompt.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        assert len(answer_ids) <= task.response_max_len
    assert task.max_prompt_tokens <= task.prompt_max_len


def test_answer_tokens_decode_back_to_answer(tokenizer) -> None:
    prompt = default_task().sample_prompts(1, step=0)[0]
    ids = tokenizer(prompt.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert score_response(prompt.answer, tokenizer.decode(ids, skip_special_tokens=True)) == 1.0


def test_rejects_configs_that_do_not_fit() -> None:
    default_task(prompt_max_len=8)  # BOS + rev + 5 digits + = is 8 tokens: fits exactly
    with pytest.raises(ValueError, match="prompt_max_len"):
        default_task(prompt_max_len=8, filler_tokens=1)
    with pytest.raises(ValueError, match="response_max_len"):
        default_task(response_max_len=5)
    with pytest.raises(ValueError):
        default_task(min_digits=4, max_digits=3)


def test_prompt_is_plain_frozen_data() -> None:
    prompt = Prompt(text="rev 1 2 =", answer="2 1", digits="12")
    with pytest.raises(AttributeError):
        prompt.text = "x"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(prompt)) == prompt
