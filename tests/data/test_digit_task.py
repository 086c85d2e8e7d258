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


def test_prompts_carry_the_answer_as_label_and_their_source() -> None:
    prompt = default_task().batch(1, 0)[0]
    assert prompt.source == "digit_reverse"
    assert score_response(prompt.label, prompt.label) == 1.0
    assert score_response(prompt.label, "") == 0.0


def test_sampler_state_is_the_batch_count_and_restores_exactly(tokenizer) -> None:
    task = default_task()
    task.bind(tokenizer)
    first = task.sample_prompts(4)
    assert first[0].prompt_ids == tuple(tokenizer(first[0].text).input_ids)
    state = task.state_dict()
    following = [task.sample_prompts(4) for _ in range(3)]
    resumed = default_task()
    resumed.bind(tokenizer)
    resumed.load_state_dict(state)
    assert [resumed.sample_prompts(4) for _ in range(3)] == following
    assert [p.text for p in first] == [p.text for p in default_task().batch(4, 1)]


def test_eval_prompts_are_fixed_and_held_out() -> None:
    task = default_task(eval_size=16)
    held_out = task.eval_prompts()
    assert len(held_out) == 16 and task.eval_prompts(5) == held_out[:5]
    assert held_out == default_task(eval_size=16).eval_prompts()
    assert [p.text for p in held_out] != [p.text for p in task.batch(16, 1)]


def test_reward_fn_is_picklable_and_batched() -> None:
    task = default_task()
    prompts = task.batch(3, 5)
    fn, shipped = pickle.loads(pickle.dumps((reward_fn, prompts)))
    assert fn(shipped, [p.label for p in shipped]) == [1.0, 1.0, 1.0]
    assert fn(shipped, ["", "", ""]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        fn(shipped, [""])


# ----------------------------------------------------------------------------- prompts
def test_prompt_format() -> None:
    prompt = default_task().batch(1, 0)[0]
    words = prompt.text.split()
    assert words[0] == "rev" and words[-1] == "="
    assert "".join(words[1:-1]) == prompt.extra["digits"]
    assert prompt.label == " ".join(reversed(prompt.extra["digits"]))
    assert 3 <= len(prompt.extra["digits"]) <= 5


def test_sample_prompts_deterministic_in_seed_and_step() -> None:
    task = default_task()
    assert task.batch(32, 3) == default_task().batch(32, 3)
    assert task.batch(32, 3) != task.batch(32, 4)
    assert task.batch(32, 3) != default_task(seed=99).batch(32, 3)
    lengths = {len(p.extra["digits"]) for p in task.batch(200, 0)}
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
    for prompt in task.batch(4, 0):
        words = prompt.text.split()
        assert words.index("rev") == 960
        assert set(words[:960]) <= set(DigitReverseTask.vocabulary_words())
    assert task.batch(2, 1) == long_task().batch(2, 1)


# ----------------------------------------------------------------------------- token lengths
@pytest.mark.parametrize("make_task", [default_task, long_task], ids=["default", "long8k"])
def test_prompts_fit_prompt_max_len(tokenizer, make_task) -> None:
    task = make_task()
    for prompt in task.batch(64, 0):
        ids = tokenizer(prompt.text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        # One token per word plus BOS: the count the task's own length check relies on.
        assert len(ids) == len(prompt.text.split()) + 1
        assert len(ids) <= task.prompt_max_len
        answer_ids = tokenizer(prompt.label, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        assert len(answer_ids) <= task.response_max_len
    assert task.max_prompt_tokens <= task.prompt_max_len


def test_answer_tokens_decode_back_to_answer(tokenizer) -> None:
    prompt = default_task().batch(1, 0)[0]
    ids = tokenizer(prompt.label, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert score_response(prompt.label, tokenizer.decode(ids, skip_special_tokens=True)) == 1.0


def test_rejects_configs_that_do_not_fit() -> None:
    default_task(prompt_max_len=8)  # BOS + rev + 5 digits + = is 8 tokens: fits exactly
    with pytest.raises(ValueError, match="prompt_max_len"):
        default_task(prompt_max_len=8, filler_tokens=1)
    with pytest.raises(ValueError, match="response_max_len"):
        default_task(response_max_len=5)
    with pytest.raises(ValueError):
        default_task(min_digits=4, max_digits=3)


def test_prompt_is_plain_frozen_data() -> None:
    prompt = Prompt(text="rev 1 2 =", label="2 1", source="digit_reverse")
    with pytest.raises(AttributeError):
        prompt.text = "x"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(prompt)) == prompt
