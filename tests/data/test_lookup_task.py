"""The embedded tool-use task and its lookup tool, without an engine."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from rlhf_orch.data.lookup_task import CALL_WORD, LookupTask, tool_answer
from rlhf_orch.env.lookup import LookupEnv
from tests.conftest import compose_config


def _task() -> LookupTask:
    return instantiate(compose_config(["data=lookup"]).data)


def test_the_answer_is_not_in_the_prompt():
    prompts = _task().batch(200, 1)
    assert all(p.text.startswith("find ") and p.text.endswith(" =") for p in prompts)
    # the value is drawn independently of the record: the prompt says nothing about it
    assert sum(p.label == p.extra["record"] for p in prompts) < 10


def test_the_lookup_tool_answers_a_call_and_scores_the_final_answer():
    env = LookupEnv()
    prompt = _task().batch(1, 1)[0]
    trajectory = env.make(prompt)
    out = trajectory.step(CALL_WORD)
    assert out["done"] is False and out["observations"] == [{"role": "tool", "content": tool_answer(prompt.label)}]
    assert out["metadata"]["tool_calls"] == 1
    final = trajectory.step(prompt.label)
    assert final["done"] is True and final["reward"] == 1.0
    assert env.make(prompt).step("0 0 0")["reward"] < 1.0 or prompt.label == "0 0 0"


def test_warm_start_demonstrations_train_on_the_models_turns_only():
    from rlhf_orch.models.tiny_build import train_tokenizer

    task = _task()
    tokenizer = train_tokenizer(task, 64, 200)  # the tiny tool model's tokenizer, as its build trains it
    texts = task.corpus(50)
    clean, masks = task.warm_start_examples(texts[:1], tokenizer, 0.0, 0)
    assert sum(masks[0]) == 2 + 3 + 1  # call + EOS, three digits + EOS
    noisy, noisy_masks = task.warm_start_examples(texts, tokenizer, 0.6, 0)
    direct = sum(len(s) < len(clean[0]) for s in noisy)
    assert 10 <= direct <= 40  # about half answer without the tool
    assert all(len(s) == len(m) for s, m in zip(noisy, noisy_masks))


def test_tool_use_experiment_composes_and_refuses_a_turn_longer_than_the_budget():
    from omegaconf import OmegaConf

    from rlhf_orch.app import check

    cfg = compose_config(["experiment=tool_use"])
    assert cfg.model.warm_start == "lookup_tool" and cfg.env._target_.endswith("LookupEnv")
    bad = compose_config(["experiment=tool_use", "env.max_tokens_per_turn=99"])
    with pytest.raises(Exception, match="env.max_tokens_per_turn=99"):
        check(bad, instantiate(bad.launcher))
    assert OmegaConf.select(cfg, "algo.num_steps") == 20
