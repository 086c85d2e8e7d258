"""trainer.old_logprobs: when the update's own forward gives the old log-probs (every fallback
reason of `old_logprobs_from_update`), where a model drops activations (`active_dropout`), the
experience phase's skipped forward, and the update's refusal of any plan the skip is not exact
for. The trainer against the oracle on both paths: tests/algo/test_oracle_matrix.py. Pure."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.utils import instantiate
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_orch.liveness import WorkCount
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.trainer.experience import make_experience
from rlhf_orch.trainer.lora import apply_lora
from rlhf_orch.trainer.metrics import OLD_LOGPROB_STATS
from rlhf_orch.trainer.old_logprobs import FROM_UPDATE, active_dropout, old_logprobs_from_update
from rlhf_orch.trainer.policy_update import train_policy
from rlhf_orch.transfer.batch import PaddedBatch, Sample
from tests.conftest import compose_config
from tests.trainer.specs import plain_spec

EXACT = dict(mode="auto", ppo_epochs=1, optimizer_steps=1, kl_in_reward=False, dropout=None)


def test_the_update_gives_the_old_logprobs_only_where_they_are_the_same():
    assert old_logprobs_from_update(**EXACT) == (True, FROM_UPDATE)
    fallbacks = {
        "trainer.old_logprobs=forward": dict(mode="forward"),
        "algo.ppo_epochs=2": dict(ppo_epochs=2),
        "3 optimizer steps per epoch": dict(optimizer_steps=3),
        "the KL penalty in the reward": dict(kl_in_reward=True),
        "the teacher's term reads them before the update (algo.distill_coef)": dict(teacher=True),
        "dropout is active in training (attention_dropout=0.1)": dict(dropout="attention_dropout=0.1"),
    }
    for reason, change in fallbacks.items():
        from_update, why = old_logprobs_from_update(**{**EXACT, **change})
        assert not from_update and why.startswith("a forward of their own: ") and reason in why, change
    with pytest.raises(ValueError, match="trainer.old_logprobs='sometimes'"):
        old_logprobs_from_update(**{**EXACT, "mode": "sometimes"})


def _llama(**config) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, **config
        )
    )


def test_dropout_is_found_in_layers_configs_and_lora_adapters():
    assert active_dropout(_llama()) is None  # HF Llama: attention_dropout 0, no dropout layer
    assert active_dropout(_llama(attention_dropout=0.1)) == "model config attention_dropout=0.1"
    # Other randomness in training mode, under the names Hugging Face configs give it.
    assert active_dropout(_llama(layerdrop=0.1)) == "model config layerdrop=0.1"
    assert active_dropout(_llama(drop_path_rate=0.2)) == "model config drop_path_rate=0.2"
    assert active_dropout(_llama(router_jitter_noise=0.01)) == "model config router_jitter_noise=0.01"
    # A classification head's dropout (GPT-NeoX's default 0.1) is no part of the causal LM's forward.
    assert active_dropout(_llama(classifier_dropout=0.1, summary_first_dropout=0.1)) is None
    assert active_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))) is None
    assert active_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))) == "1 p=0.2"
    lora = LoraSettings(rank=2, target_modules=("q_proj",))
    assert active_dropout(apply_lora(_llama(), lora, seed=0)) is None
    dropped = active_dropout(apply_lora(_llama(), dataclasses.replace(lora, dropout=0.05), seed=0))
    assert dropped is not None and "lora_dropout" in dropped and dropped.endswith("p=0.05")


def _mbs() -> list[PaddedBatch]:
    samples = [
        Sample([1, 2], [3, 4, 5], reward=float(i % 2), engine_logprobs=[-1.0, -2.0, -0.5], index=i) for i in range(4)
    ]
    return [PaddedBatch.from_samples(samples[:2], pad_id=0), PaddedBatch.from_samples(samples[2:], pad_id=0)]


class _NoForward:
    """A policy engine whose model must not run (what make_experience may ask of it otherwise)."""

    module = torch.nn.Linear(2, 2)  # (no dropout)
    global_steps = 0

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, *args, **kwargs):
        raise AssertionError("the forward ran")

    def fp16_enabled(self):  # (what Accumulation asks: a float32 engine at ZeRO-2)
        return False

    def bfloat16_enabled(self):
        return False

    def zero_optimization(self):
        return True


def _grpo(**changes):
    return dataclasses.replace(instantiate(compose_config(["algo=grpo", "algo.kl_placement=off"]).algo), **changes)


def test_experience_skips_the_forward_and_leaves_the_old_logprobs_to_the_update():
    mbs, algo = _mbs(), _grpo()
    stats, returns, from_update = make_experience(
        _NoForward(), mbs, None, None, algo, {0: 1.0, 1: -1.0, 2: 0.5, 3: -0.5},
        plain_spec(train_batch_size=4), torch.device("cpu"), 1, False, WorkCount(),
    )  # fmt: skip
    assert from_update and stats["old_logprobs_from_update"] == 1.0 and returns == []
    assert not set(OLD_LOGPROB_STATS) & set(stats)  # the update measures them
    assert all("old_logprobs" not in mb.fields for mb in mbs)
    assert mbs[0].fields["advantages"][0][mbs[0].action_mask[0]].tolist() == [1.0] * 3
    # Two optimizer steps (or trainer.old_logprobs=forward): the forward runs.
    with pytest.raises(AssertionError, match="the forward ran"):
        make_experience(
            _NoForward(), _mbs(), None, None, algo, {}, plain_spec(train_batch_size=2),
            torch.device("cpu"), 1, False, WorkCount(),
        )  # fmt: skip


class _NoForwardWithDropout(_NoForward):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))


@pytest.mark.parametrize("case", ["forward", "two_epochs", "kl_in_reward", "dropout"])
def test_a_forward_decided_before_the_plan_skips_the_plan_s_all_reduces(monkeypatch, case):
    """trainer.old_logprobs=forward, several epochs, the KL in the reward or dropout: the forward runs
    whatever the optimizer-step plan says, so its two all-reduces over the ranks (every step) are not
    made for the decision."""
    import rlhf_orch.trainer.experience as experience

    def no_plan(*args, **kwargs):
        raise AssertionError("the optimizer-step plan was made")

    monkeypatch.setattr(experience, "plan_optimizer_steps", no_plan)
    algo = _grpo(ppo_epochs=2 if case == "two_epochs" else 1)
    if case == "kl_in_reward":
        algo = instantiate(compose_config(["algo=grpo", "algo.kl_placement=in_reward"]).algo)
        assert algo.kl_in_reward
    engine = _NoForwardWithDropout() if case == "dropout" else _NoForward()
    spec = plain_spec(train_batch_size=4, **({"old_logprobs": "forward"} if case == "forward" else {}))
    with pytest.raises(AssertionError, match="the forward ran"):
        make_experience(engine, _mbs(), None, None, algo, {}, spec, torch.device("cpu"), 1, False, WorkCount())


@pytest.mark.parametrize("epochs,train_batch", [(2, 4), (1, 2)], ids=["two_epochs", "two_steps"])
def test_an_update_the_skip_is_not_exact_for_is_refused(epochs, train_batch):
    """The decision travels from make_experience to the update, which holds its own plan to it:
    more than one epoch, or more than one optimizer step, is refused before any forward runs."""
    with pytest.raises(RuntimeError, match="the old log-probs were left to the update's forward, but"):
        train_policy(
            _NoForward(), _mbs(), _grpo(ppo_epochs=epochs), 4, plain_spec(train_batch_size=train_batch),
            1, False, WorkCount(), old_from_update=True,
        )  # fmt: skip
