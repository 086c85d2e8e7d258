"""The plain parts the trainer's Ray actors are shells over (rlhf_orch/trainer/*.py), without Ray,
DeepSpeed or a model: the spec's refusal of another world, gradient accumulation's boundaries and
norms, the policy's weight views, the seeded perturbation, the dump's sequences, the inbox's
arrival and the frozen model's forward loop. Pure."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.accumulation import Accumulation
from rlhf_orch.trainer.policy_weights import PolicyWeights
from rlhf_orch.trainer.probes import perturb
from rlhf_orch.trainer.spec import respecced
from rlhf_orch.trainer.token_weighting import plan_optimizer_steps
from rlhf_orch.trainer.trained_sequences import trained_sequences
from rlhf_orch.transfer.batch import PaddedBatch, Sample
from rlhf_orch.transfer.inbox import arrived, staged_micro_batches
from tests.trainer.specs import plain_spec


def _batch(*responses: list[int], first_index: int = 0) -> PaddedBatch:
    samples = [
        Sample(prompt_ids=[5, 6], response_ids=r, reward=0.0, index=first_index + k, weight_version=3)
        for k, r in enumerate(responses)
    ]
    return PaddedBatch.from_samples(samples, pad_id=0)


def test_a_spec_keeps_its_world():
    spec = plain_spec()
    assert respecced(spec, None, "actor", 1) is spec
    assert respecced(spec, plain_spec(lr=1.0), "actor", 1).lr == 1.0
    with pytest.raises(ValueError, match="a critic group of 1 ranks cannot take data_parallel_size=2"):
        respecced(spec, plain_spec(data_parallel_size=2), "critic", 1)


class _Engine:
    """What `Accumulation` asks of a DeepSpeed engine, recorded."""

    def __init__(self, norms, zero_stage=2, dtype="float32"):
        self.calls, self.norms = [], list(norms)
        self.module = torch.nn.Linear(2, 2, bias=False)
        self.zero_stage, self.dtype = zero_stage, dtype

    def fp16_enabled(self):
        return self.dtype == "float16"

    def bfloat16_enabled(self):
        return self.dtype == "bfloat16"

    def zero_optimization(self):
        return self.zero_stage > 0

    def set_gradient_accumulation_boundary(self, boundary):
        self.calls.append(("boundary", boundary))

    def backward(self, loss, scale_wrt_gas):
        self.calls.append(("backward", float(loss)))

    def step(self):
        self.calls.append(("step",))
        self.module.weight.grad = None  # (DeepSpeed's step clips and zeroes the gradients)

    def get_global_grad_norm(self):
        return self.norms.pop(0)


def test_the_accumulation_steps_at_each_boundary_and_keeps_the_largest_norm():
    mbs = [_batch([1, 2]), _batch([3]), _batch([4, 5, 6]), _batch([7])]
    plan = plan_optimizer_steps(mbs, 2, 1)  # two sequences a step: steps [0, 1], [2, 3]
    work_done = WorkCount()
    engine = _Engine([1.5, None], zero_stage=2)
    accumulation = Accumulation(engine, work_done)
    assert accumulation.with_grad_norm({}) == {}  # no norm computed yet: none reported
    losses = [accumulation.backward(plan, k, torch.tensor(2.0), 0.5) for k in range(4)]
    assert losses == [1.0] * 4
    assert [c[1] for c in engine.calls if c[0] == "boundary"] == [False, True, False, True]
    assert [c for c in engine.calls if c[0] == "backward"] == [("backward", 1.0)] * 4
    assert accumulation.grad_norms == [1.5]  # the second step's norm was not computed
    assert work_done.count > 0  # backward and step count as collectives
    accumulation.grad_norms.append(float("nan"))
    assert math.isnan(accumulation.with_grad_norm({"loss": 1.0})["grad_norm"])  # a NaN is kept for the guard


def test_at_stage_0_the_gradient_norm_is_taken_before_the_step_clips_it():
    """DeepSpeed's stage 0 (one rank: zero_stage_to_run) keeps no gradient norm in float32: the
    accumulation takes it from the gradients before the step, as ZeRO reports it (unclipped)."""
    plan = plan_optimizer_steps([_batch([1, 2])], 2, 1)
    engine = _Engine([None], zero_stage=0)
    engine.module.weight.grad = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    accumulation = Accumulation(engine, WorkCount())
    accumulation.backward(plan, 0, torch.tensor(1.0), 1.0)
    assert accumulation.grad_norms == [5.0] and engine.module.weight.grad is None
    # DeepSpeed's 16-bit optimizers keep the norm at stage 0: it is not taken a second time here
    bf16_engine = _Engine([2.0], zero_stage=0, dtype="bfloat16")
    bf16_engine.module.weight.grad = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    bf16 = Accumulation(bf16_engine, WorkCount())
    assert not bf16.norm_before_step

    def taken_again():
        raise AssertionError("the norm was taken beside DeepSpeed's")

    bf16._gradient_norm = taken_again
    bf16.backward(plan, 0, torch.tensor(1.0), 1.0)
    assert bf16.grad_norms == [2.0]


def test_without_lora_a_sync_sends_every_weight_and_a_lora_mode_is_refused():
    module = torch.nn.Linear(3, 2)
    views = PolicyWeights(module, 0, None)
    assert views.for_sync() is views.full and views.adapter is None
    assert [m.name for m in views.full.metas()] == ["weight", "bias"]
    with pytest.raises(ValueError, match="lora sync mode 'adapter'"):
        views.for_sync("adapter")


def test_the_perturbation_is_seeded():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    before = a.weight.detach().clone()
    for module in (a, b):
        perturb(PolicyWeights(module, 0, None).full, 0.1, seed=7)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, before)


def test_the_dump_shows_each_asked_sequence_as_it_was_trained():
    mb = _batch([7, 8, 9], [10], first_index=4)
    mb.fields["advantages"] = torch.arange(mb.action_mask.numel(), dtype=torch.float32).reshape(mb.action_mask.shape)
    (seq,) = trained_sequences([mb], [5], pad_id=0)
    assert seq["index"] == 5 and seq["ids"] == [5, 6, 10] and seq["action"] == [0, 0, 1]
    assert seq["weight_version"] == 3 and seq["turn_advantages"] == [seq["advantage"]]
    assert trained_sequences([mb], [9], pad_id=0) == []


def test_the_inbox_refuses_a_shard_with_missing_micro_batches_and_moves_arrivals():
    mb = _batch([1, 2])
    assert staged_micro_batches({0: [mb]}, 0) == [mb]
    with pytest.raises(RuntimeError, match="shard 0: 1 streamed micro-batches never arrived"):
        staged_micro_batches({0: [mb, None]}, 0)
    assert arrived(mb, None) is mb  # a sink keeps what it got
    assert arrived(mb, torch.device("cpu")).input_ids.device.type == "cpu"


def test_a_frozen_model_runs_each_micro_batch_once_and_answers_on_cpu(monkeypatch):
    from rlhf_orch.trainer import frozen_models

    seen = []

    def logprobs(model, mb, temperature, share_prompts):
        seen.append((mb, temperature, share_prompts))
        return torch.zeros(mb.action_mask.shape, dtype=torch.float64)

    monkeypatch.setattr(frozen_models, "sequence_logprobs", logprobs)
    mbs = [_batch([1, 2]), _batch([3])]
    work_done = WorkCount()
    out = frozen_models.frozen_logprobs(
        torch.nn.Identity(), lambda: mbs, 0, plain_spec(temperature=0.7), 1, False, work_done
    )
    assert [s[0] for s in seen] == mbs and {s[1:] for s in seen} == {(0.7, False)}
    assert [t.dtype for t in out] == [torch.float32] * 2 and work_done.count >= 2


def test_the_test_hooks_are_the_tests_subclass_not_the_product_actor():
    from rlhf_orch.trainer.policy import PolicyWorker
    from tests.trainer.probed_workers import ProbedPolicyWorker

    for hook in ("logprobs_of", "perturb_weights"):
        assert hasattr(ProbedPolicyWorker, hook) and not hasattr(PolicyWorker, hook)
    assert not hasattr(PolicyWorker, "send_raw_broadcast")  # scripts/bench/bench_sync.py's BenchTrainer has it
