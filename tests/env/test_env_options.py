"""The `env` group's options without an engine: config keys and their ranges, a user's class
loaded from a file (errors name file and line), skyrl-gym environments from the installed package
on rows in SkyRL's layout, the observation renderer, and the trainer-side loss mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from rlhf_orch.config.problems import ConfigError
from rlhf_orch.config.ranges import validate_values
from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, prompt_messages, row_extras
from rlhf_orch.env.custom import CustomEnv
from rlhf_orch.env.observations import ObservationRenderer
from rlhf_orch.env.turn_driver.runner import MultiTurnRunner
from rlhf_orch.env.single_turn import SingleTurn
from rlhf_orch.env.turn_driver.trajectory import TrajectoryLimits
from rlhf_orch.transfer.batch import LOSS_MASK, PackedBatch, PaddedBatch, Sample, apply_loss_mask
from tests.conftest import compose_config
from tests.env.test_env_runner import OneTokenPerMessage, ScriptedGenerator


def _typed(overrides):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_config(overrides))


# --------------------------------------------------------------------------- config
def test_the_default_is_single_turn():
    assert isinstance(instantiate(compose_config([]).env), SingleTurn)
    assert not instantiate(compose_config([]).env).multi_turn


@pytest.mark.parametrize(
    "key,value",
    [
        ("max_turns", 0),
        ("max_tokens_per_turn", 0),
        ("max_observation_tokens", 0),
        ("tool_timeout_s", 0),
        ("concurrency", 0),
        ("reward", "mean"),
        ("observation_format", "xml"),
        ("tool_format", ""),
        ("tool_memory_mb", 1),
    ],
)
def test_env_keys_out_of_range_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"env.{key}="):
        validate_values(_typed(["env=python_tool", f"env.{key}={value}"]))


def test_a_multi_turn_key_with_single_turn_is_refused():
    from rlhf_orch.config.ranges import added_key_problems

    problems = added_key_problems(_typed(["+env.max_turns=3"]))
    assert problems and "env.max_turns" in str(problems[0].key)


# --------------------------------------------------------------------------- env=custom
def test_custom_env_class_is_loaded_once_and_built_per_row(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(
        "LOADS = []\nLOADS.append(1)\n"
        "class Echo:\n"
        "    def __init__(self, env_config=None, extras=None):\n"
        "        self.config, self.extras = env_config, extras\n"
        "    def init(self, prompt):\n        return prompt, {}\n"
        "    def step(self, action):\n        return {'observations': [], 'reward': 1.0, 'done': True}\n"
    )
    env = CustomEnv(path=str(path), name="Echo", env_config={"k": 1})
    a = env.make(Prompt(text="q", label="42", extra={"id": 7}))
    b = env.make(Prompt(text="r", label="43"))
    assert a is not b and a.config == {"k": 1}
    assert a.extras == {"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {"id": 7}}
    assert __import__("sys").modules[type(a).__module__].LOADS == [1]  # imported once per process


def test_custom_env_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import os\n\nx = 1 +\n")
    with pytest.raises(EnvError, match=r"broken.py:3: SyntaxError"):
        CustomEnv(path=str(path), name="Env").make(Prompt(text="q"))
    with pytest.raises(EnvError, match="no such file"):
        CustomEnv(path=str(tmp_path / "nope.py"), name="Env").make(Prompt(text="q"))
    ok = tmp_path / "ok.py"
    ok.write_text("class NoStep:\n    def init(self, p):\n        return p, {}\n")
    with pytest.raises(EnvError, match="has no step"):
        CustomEnv(path=str(ok), name="NoStep").make(Prompt(text="q"))
    with pytest.raises(EnvError, match="defines no 'Missing'"):
        CustomEnv(path=str(ok), name="Missing").make(Prompt(text="q"))


def test_a_hung_init_in_the_check_before_ray_is_refused_in_one_line_at_the_deadline(tmp_path):
    """The driver starts the environment for the first prompt before Ray (`check`): an init that
    never returns is given up at env.tool_timeout_s and refused naming the key, not a hung start-up."""
    import time

    path = tmp_path / "hangs.py"
    path.write_text(
        "import time\n"
        "class Hangs:\n"
        "    def __init__(self, env_config=None, extras=None):\n        pass\n"
        "    def init(self, prompt):\n"
        "        deadline = time.monotonic() + 30\n"
        "        while time.monotonic() < deadline:\n            time.sleep(0.02)\n"
        "        return prompt, {}\n"
        "    def step(self, action):\n        return {'observations': [], 'reward': 1.0, 'done': True}\n"
    )
    env = CustomEnv(path=str(path), name="Hangs", observation_format="plain", tool_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(
        EnvError,
        match=r"env.tool_timeout_s=1: starting the environment for the first prompt \(env.make, env.init\) "
        r"took longer",
    ):
        env.check(Prompt(text="q", label="1"), _ChatMLTokenizer())
    assert time.monotonic() - t0 < 20  # (the init lasts 30 s unless given up)


# --------------------------------------------------------------------------- env=skyrl
def _skyrl_row_prompt() -> Prompt:
    messages = ({"role": "user", "content": "What is 6 times 7? Answer as #### N."},)
    return Prompt(
        text="What is 6 times 7?",
        label="42",
        messages=messages,
        env_fields={"env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": "42"}},
        extra={"max_turns": 3},
    )


def test_skyrl_gym_multi_turn_environment_runs_unchanged():
    pytest.importorskip("skyrl_gym")
    from rlhf_orch.env.skyrl import SkyRLEnv

    prompt = _skyrl_row_prompt()
    env = SkyRLEnv(observation_format="plain")
    made = env.make(prompt)
    assert type(made).__module__.startswith("skyrl_gym.")
    script = {(0, 0): [5, 5], (0, 1): [6, 6]}  # wrong answers: the environment asks again, then ends
    generator = ScriptedGenerator(script)
    generator.decode = lambda ids: {(5, 5): "I think 40", (6, 6): "#### 42"}[tuple(ids)]
    rendered = []

    class Render(OneTokenPerMessage):
        def observation(self, messages, turn_closed, max_tokens):
            rendered.append(messages)
            return SimpleNamespace(ids=[900] * 3, truncated=False, messages=list(messages), closing_added=False)

    runner = MultiTurnRunner(env.make, generator, Render(), TrajectoryLimits(4, 8, 64, 16), 2, 5.0)
    (t,) = list(runner.run([(0, prompt, [1, 2])]))
    assert t.counts.turns == 2 and t.done and not t.truncated
    assert rendered[0][0]["role"] == "user" and "####" in rendered[0][0]["content"]  # skyrl's own follow-up
    assert t.turn_rewards[-1] == 1.0 and t.reward("last") == 1.0
    assert t.loss_mask == [1, 1, 0, 0, 0, 1, 1]


def test_skyrl_env_class_is_checked_against_the_registry():
    pytest.importorskip("skyrl_gym")
    from rlhf_orch.env.skyrl import SkyRLEnv

    with pytest.raises(EnvError, match="skyrl-gym registers .*gsm8k"):
        SkyRLEnv(env_class="no_such_env")


def test_skyrl_rows_choosing_an_environment_that_runs_model_code_are_refused_once_loaded(tmp_path, tiny_model):
    """The data preparation's side (what a hub dataset's rows choose, which the config check does
    not read): every loaded row's env_class, training and held-out; one row choosing searchcode
    refuses the option in one line naming the key that allows it; allowed, the start-up says so."""
    pytest.importorskip("skyrl_gym")
    import pandas as pd

    from rlhf_orch.data.files import PromptDataset
    from rlhf_orch.env.skyrl import SkyRLEnv

    def rows(path, classes):
        pd.DataFrame(
            [{"prompt": "q", "env_class": c, "reward_spec": {"method": "rule", "ground_truth": "1"}} for c in classes]
        ).to_parquet(path)
        return str(path)

    task = PromptDataset(
        train_files=[rows(tmp_path / "train.parquet", ["gsm8k", "gsm8k"])],
        val_files=[rows(tmp_path / "val.parquet", ["searchcode"])],
        label_key="reward_spec.ground_truth",
        chat_template=False,
    )
    task.bind(tiny_model.tokenizer())
    assert task.env_field_values("env_class") == {"gsm8k", "searchcode"}
    with pytest.raises(EnvError) as refused:
        SkyRLEnv().bind(task)
    assert str(refused.value).startswith(
        "env.allow_unsandboxed_code=false: skyrl-gym's searchcode (the data's env_class column) "
        "runs the model's code in the engine's process"
    )
    assert "\n" not in str(refused.value) and "set env.allow_unsandboxed_code=true" in str(refused.value)
    allowed = SkyRLEnv(allow_unsandboxed_code=True)
    allowed.bind(task)
    assert any(
        "searchcode" in line and "outside rlhf_orch's sandbox (env.allow_unsandboxed_code=true" in line
        for line in allowed.describe()
    )
    plain = SkyRLEnv()
    plain.bind(SimpleNamespace(prompt_max_len=8, env_field_values=lambda name: {"gsm8k"}))
    assert not any("sandbox" in line for line in plain.describe())


def test_row_extras_follow_skyrl_layout():
    prompt = _skyrl_row_prompt()
    extras = row_extras(prompt)
    assert extras["reward_spec"]["ground_truth"] == "42" and extras["env_class"] == "gsm8k_multi_turn"
    assert extras["extra_info"] == {"max_turns": 3}
    assert prompt_messages(prompt) == [dict(prompt.messages[0])]
    assert prompt_messages(Prompt(text="plain")) == [{"role": "user", "content": "plain"}]


# --------------------------------------------------------------------------- observations
class _ChatMLTokenizer:
    """A character-level stand-in with a ChatML-like template (what Qwen's renders)."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )
        return [ord(c) for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_chat_template_renders_only_the_new_messages():
    render = ObservationRenderer(_ChatMLTokenizer(), "chat_template")
    ids = render([{"role": "tool", "content": "42"}])
    assert "".join(map(chr, ids)) == "<tool>42</><assistant>"
    assert (
        "".join(map(chr, ObservationRenderer(_ChatMLTokenizer(), "plain")([{"role": "tool", "content": "42"}]))) == "42"
    )


def test_a_template_that_drops_tool_turns_is_refused_with_the_fix(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.path())
    # a template that renders the user's turns only (the tiny model's renders conversations)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(EnvError, match="env.observation_format=plain"):
        ObservationRenderer(tokenizer, "chat_template")([{"role": "tool", "content": "1 2"}])


# --------------------------------------------------------------------------- the trainer's mask
def test_loss_mask_travels_as_a_field_and_becomes_holes_in_the_action_mask():
    samples = [
        Sample(
            [1, 2], [3, 4, 5, 6], 1.0, engine_logprobs=[-1.0] * 4, index=0, fields={LOSS_MASK: [1.0, 0.0, 0.0, 1.0]}
        ),
        Sample([1], [7, 8], 0.0, engine_logprobs=[-1.0] * 2, index=1, fields={LOSS_MASK: [1.0, 1.0]}),
    ]
    for batch in (PaddedBatch.from_samples(samples, 0), PackedBatch.from_samples(samples)):
        before = int(batch.action_mask.sum())
        out = apply_loss_mask(batch)
        assert LOSS_MASK not in out.fields and before == 6 and int(out.action_mask.sum()) == 4
        kept = out.action_mask.flatten().tolist()
        # sample 0: positions predicting 3, 4, 5, 6 -> only 3 and 6 remain actions
        assert kept.count(True) == 4
    no_field = PackedBatch.from_samples([Sample([1], [2], 0.0, engine_logprobs=[0.0], index=0)])
    assert torch.equal(apply_loss_mask(no_field).action_mask, no_field.action_mask)
