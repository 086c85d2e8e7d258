"""The teacher (teacher=<model option>): refused before anything starts when it does nothing, when
the algorithm's teacher term has none, or when its tokenizer reads the policy's token ids otherwise
(`rlhf_orch.models.teacher`, `rlhf_orch.config.checks_algo.teacher`); planned with its own shape."""

from __future__ import annotations

import copy

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.app import check, plan_line
from rlhf_orch.config.problems import ConfigError
from rlhf_orch.memory.check import check_memory
from rlhf_orch.models.token_ids import tokenizer_mismatch
from rlhf_orch.orchestration.inputs import InputError, prepare_inputs
from tests.conftest import compose_config


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["algo=on_policy_distill"], "teacher", "reads a teacher's log-prob of every sampled token: set teacher="),
        (["algo=grpo", "algo.distill_coef=0.1"], "teacher", "set teacher=<model option>"),
        (["teacher=tiny"], "teacher", "does nothing: no term of the algorithm reads a teacher"),
        (["algo=on_policy_distill", "teacher=tiny", "teacher.lora.rank=4"], "teacher.lora.rank", "frozen"),
        (["algo=on_policy_distill", "teacher=tiny", "algo.distill_coef=-1"], "algo.distill_coef", ">= 0"),
        (["algo=on_policy_distill", "teacher=tiny", "teacher.context_len=32"], "teacher.context_len", "= 48 tokens"),
        (["algo=dapo", "algo.distill_coef=0.5", "teacher=tiny"], "algo.distill_coef", "dynamic sampling drops"),
    ],
)
def test_a_teacher_that_does_nothing_or_is_missing_is_refused(overrides, key, fragment):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as refused:
        check(cfg, instantiate(cfg.launcher))
    assert f"{key}=" in str(refused.value) and fragment in str(refused.value), str(refused.value)


def test_the_teacher_term_places_reference_ranks_without_a_kl_term():
    cfg = compose_config(["algo=on_policy_distill", "teacher=tiny"])
    typed, plan = check(cfg, instantiate(cfg.launcher))
    assert not typed.algo.needs_reference and plan.slots_for("reference") and plan.reference_in_actor
    assert "reference=1(teacher, in actor)" in plan_line(typed, plan)  # the start-up line says what it holds
    cfg = compose_config(["algo=grpo", "algo.distill_coef=0.5", "teacher=tiny", "placement.reference_in_actor=false"])
    typed, plan = check(cfg, instantiate(cfg.launcher))
    assert typed.algo.frozen_models == ("ref", "teacher") and "reference=1(ref+teacher)" in plan_line(typed, plan)


def test_each_teacher_option_is_the_model_option_of_its_name():
    from pathlib import Path

    names = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "teacher").glob("*.yaml"))
    assert "none" in names and compose_config(["teacher=none"]).teacher is None
    for name in names:
        if name != "none":
            as_teacher = OmegaConf.to_container(compose_config([f"teacher={name}"]).teacher)
            assert as_teacher == OmegaConf.to_container(compose_config([f"model={name}"]).model), name


def test_a_tokenizer_mismatch_is_named(smollm2_tokenizer, tiny_model):
    assert tokenizer_mismatch(smollm2_tokenizer, copy.deepcopy(smollm2_tokenizer)) is None
    assert "tokens against the policy's" in tokenizer_mismatch(smollm2_tokenizer, tiny_model.tokenizer())

    class Swapped:  # two of SmolLM2's tokens under each other's ids
        eos_token_id = smollm2_tokenizer.eos_token_id

        def get_vocab(self):
            vocab = dict(smollm2_tokenizer.get_vocab())
            vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
            return vocab

    assert tokenizer_mismatch(smollm2_tokenizer, Swapped()).startswith("2 of 49152 tokens under other ids")

    class OtherEnd(Swapped):  # the same vocabulary, another end-of-sequence id
        eos_token_id = smollm2_tokenizer.eos_token_id + 1

        def get_vocab(self):
            return smollm2_tokenizer.get_vocab()

    assert tokenizer_mismatch(smollm2_tokenizer, OtherEnd()).startswith("end-of-sequence id")


def test_a_teacher_on_another_tokenizer_is_refused_before_ray(smollm2_path, tiny_model_path):
    cfg = compose_config(["algo=on_policy_distill", "teacher=smollm2_135m"])  # the tiny policy, SmolLM2 teacher
    with pytest.raises(InputError, match=r"^teacher \(.*SmolLM2.*\): its tokenizer is not the policy's \(49152 tokens"):
        prepare_inputs(cfg, OmegaConf.to_object(cfg))  # one line, exit 2 (app.main)


def _reference_terms(*overrides: str) -> dict[str, int]:
    cfg = compose_config(["model=smollm2_student", "teacher=smollm2_135m", "algo=on_policy_distill", *overrides])
    typed, plan = check(cfg, instantiate(cfg.launcher))
    memory = check_memory(typed, plan, on_gpu=False, reward_model=False).plan
    (reference,) = [p for p in memory.processes if p.role == "reference"]
    assert "teacher from" in memory.model  # the header names where the teacher's shape was read
    return {t.name: t.bytes for t in reference.terms}


def test_the_teacher_is_in_the_memory_plan_in_its_own_shape_and_dtype(smollm2_path):
    terms = _reference_terms()
    # SmolLM2-135M in float32 (134.5M parameters), and no reference of the student's: no KL term
    assert 0.5e9 < terms["teacher weights"] < 0.56e9 and "weights" not in terms
    assert terms["teacher weights"] / 2 == _reference_terms("teacher.dtype=bfloat16")["teacher weights"]
    # with a KL term too: the student's reference (8 layers, ~56M) beside it, one runtime
    both = _reference_terms("algo.kl_placement=in_loss", "algo.kl_coef=0.01")
    assert 0.2e9 < both["weights"] < 0.25e9 and both["teacher weights"] == terms["teacher weights"]
    # a LoRA student hosting it: the reference is its own base (no weights or load of its own), the teacher's stay
    lora = _reference_terms("algo.kl_placement=in_loss", "algo.kl_coef=0.01", "model.lora.rank=8")
    assert "weights" not in lora and "checkpoint load" not in lora
    assert lora["teacher weights"] == terms["teacher weights"] and "teacher checkpoint load" in lora


def test_a_reward_model_on_another_tokenizer_is_refused_with_the_same_rule(tiny_model, smollm2_tokenizer):
    """reward=model asks the same question of its checkpoint (`rlhf_orch.models.token_ids`)."""
    from rlhf_orch.reward.model import RewardModelError
    from rlhf_orch.reward.scoring import build_reward

    reward = build_reward(compose_config(["reward=model"]).reward).model
    path = reward.resolve(tiny_model)  # the tiny reward model, on the tiny tokenizer
    reward.check(path, tiny_model.tokenizer())
    with pytest.raises(
        RewardModelError, match=r"different tokenizer than the policy \(49 tokens against the policy's 49152\)"
    ):
        reward.check(path, smollm2_tokenizer)
