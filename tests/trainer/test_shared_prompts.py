"""trainer.share_prompts: a packed micro-batch's repeated prompts run once, and every log-prob,
value and gradient equals the plain packed forward's up to float32 rounding: the two rows run the
same products in different orders, so the shared row's log-probs and gradients must be as close to
a float64 reference as the plain row's own (`_assert_no_less_accurate`), not within a constant one
host's run happened to meet.

On the tiny model (log-probs, values, gradients; with and without gradient checkpointing) and on
SmolLM2-135M-Instruct with its own chat template's prompts (log-probs and gradients; the real
model: 30 layers, grouped-query attention -- 9 query heads over 3 key/value heads, so the repeated
keys are exercised -- and RoPE over the positions that continue after a shared prompt).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_orch.trainer.forward import (
    enable_gradient_checkpointing,
    load_critic,
    load_policy,
    sequence_logprobs,
    sequence_values,
)
from rlhf_orch.trainer import shared_prompts
from rlhf_orch.trainer.shared_prompts import BatchedBlockAttention, BranchLoopAttention, shared_prompt_layout
from rlhf_orch.transfer.batch import PackedBatch, Sample


def _samples(groups: list[tuple[int, list[int]]], vocab: int = 40, seed: int = 0) -> list[Sample]:
    """Per group: a prompt of the given length and one sample per response length, interleaved
    with the next group's (sharing must not depend on the order)."""
    gen = torch.Generator().manual_seed(seed)
    per_group = []
    for prompt_len, responses in groups:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen)
        per_group.append([(prompt, torch.randint(3, vocab, (r,), generator=gen)) for r in responses])
    order = [g[i] for i in range(max(len(g) for g in per_group)) for g in per_group if i < len(g)]
    return [Sample(prompt_ids=p, response_ids=r, reward=0.0, index=i) for i, (p, r) in enumerate(order)]


GROUPS = [(9, [4, 1, 6, 3]), (5, [2, 7]), (6, [5]), (3, [0])]  # shared by 4 and 2; a lone one; no response


def test_the_row_holds_each_prompt_once_and_every_token_where_the_plain_row_has_it():
    mb = PackedBatch.from_samples(_samples(GROUPS))
    layout = shared_prompt_layout(mb)
    assert layout.num_tokens == (9 + 14) + (5 + 9) + 11 + 3 < mb.num_tokens == 4 * 9 + 14 + 2 * 5 + 9 + 11 + 3
    assert torch.equal(layout.input_ids[layout.model_position], mb.input_ids)
    assert torch.equal(layout.position_ids[layout.model_position], mb.position_ids)
    assert [len(s.branches) for s in layout.segments] == [4, 2, 0, 0]


def test_a_small_saving_runs_the_plain_row_where_the_attention_is_batched(monkeypatch):
    # 4 samples of a 6-token prompt with long answers: 18 of 82 tokens saved (22 %)
    mb = PackedBatch.from_samples(_samples([(6, [14, 15, 16, 13])]))
    assert shared_prompt_layout(mb).num_tokens == mb.num_tokens - 18  # the loop: any saving
    monkeypatch.setitem(shared_prompts.ATTENTION_BY_DEVICE, "cpu", BatchedBlockAttention)
    assert shared_prompt_layout(mb) is None  # under BatchedBlockAttention.min_token_saving
    assert shared_prompt_layout(PackedBatch.from_samples(_samples(GROUPS))) is not None


def test_a_shared_row_is_refused_on_another_attention(tiny_model_path):
    # HF's own sdpa would ignore the row's attention and let the branches see each other, silently
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa")
    with pytest.raises(
        ValueError, match="trainer.share_prompts needs the 'varlen_sdpa' attention, the model has 'sdpa'"
    ):
        sequence_logprobs(model, PackedBatch.from_samples(_samples(GROUPS)), 1.0, share_prompts=True)


def test_no_shared_prompt_means_no_other_row():
    assert shared_prompt_layout(PackedBatch.from_samples(_samples([(4, [2]), (5, [3])]))) is None


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    torch.manual_seed(0)
    critic = load_critic(tiny_model_path, "float32").eval()
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.1)
    return load_policy(tiny_model_path, "float32"), critic


def _logprobs_and_grads(policy, mb, share: bool):
    policy.zero_grad()
    lp = sequence_logprobs(policy, mb, 0.7, share_prompts=share)
    (lp * torch.linspace(0.5, 1.5, lp.numel()) * mb.action_mask).sum().backward()
    return lp.detach(), [p.grad.detach().clone() for p in policy.parameters() if p.grad is not None]


def _assert_no_less_accurate(shared: list[torch.Tensor], plain: list[torch.Tensor], exact: list[torch.Tensor]) -> None:
    """The float32 bound, scaled by the computation rather than a constant one host met: both rows
    compute the same sums in different orders, so each is the exact value plus float32 rounding of
    the same kind and scale. Per tensor, the shared row's distance from a float64 reference
    (`exact`: the same model in float64, plain row) must be of the scale of the plain row's own --
    the rounding this host's float32 makes of this very computation -- measured as L2 norms over the
    tensor (its largest element is a tail statistic: it was 4x the plain row's on SmolLM2 while the
    norms were within 2.2x). The factor 4 is a margin over that measured 2.2x (one host, not a
    derivation); the added float32 ulp of the reference's norm covers the reference's own float32
    pieces (the vocabulary reductions). A wrong shared row is far outside: prefix keys scaled by
    0.999 put the first tensor 25x past the bound, a mask one token off fails every case."""
    eps = torch.finfo(torch.float32).eps
    for k, (s, p, x) in enumerate(zip(shared, plain, exact)):
        s, p, x = s.double(), p.double(), x.double()
        bound = 4 * (p - x).norm() + eps * x.norm()
        assert (s - x).norm() <= bound, (
            f"tensor {k}: shared row {(s - x).norm():.3g} from the exact value (L2), bound {bound:.3g}"
        )


@pytest.fixture(params=[BranchLoopAttention, BatchedBlockAttention], ids=["branch_loop", "batched_blocks"])
def attention(request, monkeypatch):
    """Both implementations of the row's attention (CPU runs the loop, CUDA the batched blocks)."""
    monkeypatch.setitem(shared_prompts.ATTENTION_BY_DEVICE, "cpu", request.param)
    return request.param


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_shared_prompts_give_the_plain_forward_s_logprobs_values_and_gradients(
    tiny, tiny_model_path, checkpointing, attention
):
    policy, critic = tiny
    if checkpointing:  # the layout's kwargs must reach the attention through the recomputation
        policy = load_policy(tiny_model_path, "float32")
        enable_gradient_checkpointing(policy)
    policy.train()
    mb = PackedBatch.from_samples(_samples(GROUPS))
    lp_plain, grad_plain = _logprobs_and_grads(policy, mb, share=False)
    lp_shared, grad_shared = _logprobs_and_grads(policy, mb, share=True)
    exact = load_policy(tiny_model_path, "float64").train()
    if checkpointing:
        enable_gradient_checkpointing(exact)
    lp_exact, grad_exact = _logprobs_and_grads(exact, mb, share=False)
    assert (lp_plain[mb.action_mask] < 0).all()
    _assert_no_less_accurate([lp_shared], [lp_plain], [lp_exact])
    _assert_no_less_accurate(grad_shared, grad_plain, grad_exact)
    with torch.no_grad():
        exact_critic = load_critic(tiny_model_path, "float64").eval()
        exact_critic.load_state_dict({k: v.double() for k, v in critic.state_dict().items()})
        _assert_no_less_accurate(
            [sequence_values(critic, mb, share_prompts=True)],
            [sequence_values(critic, mb)],
            [sequence_values(exact_critic, mb)],
        )


_EXACT: dict[str, tuple] = {}  # the float64 reference of a module's test, by model


def test_on_smollm2_with_its_chat_template(smollm2_student_path, smollm2_tokenizer, attention):
    # (SmolLM2's tokenizer, template, embeddings and head on its first two layers: the layout is the
    # template's and the tokenizer's; the whole model's depth made the float64 reference ~30 s)
    tok = smollm2_tokenizer
    policy = load_policy(smollm2_student_path, "float32").train()
    questions = ["What is 3 + 4? Answer inside <answer></answer>.", "What is 9 + 1? Answer inside <answer></answer>."]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]
    answers = [
        "<answer>7</answer>",
        "The sum is <answer>7</answer>",
        "<answer>10</answer>",
        "9 + 1 = <answer>10</answer>",
    ]
    samples = [
        Sample(
            prompt_ids=prompts[i // 2],
            response_ids=tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id],
            reward=0.0,
            index=i,
        )
        for i, a in enumerate(answers)
    ]
    mb = PackedBatch.from_samples(samples)
    assert shared_prompt_layout(mb).num_tokens < mb.num_tokens * 0.6
    lp_plain, grad_plain = _logprobs_and_grads(policy, mb, share=False)
    lp_shared, grad_shared = _logprobs_and_grads(policy, mb, share=True)
    del policy
    if "smollm2" not in _EXACT:  # (no shared prompts: the same for both attentions, computed once)
        _EXACT["smollm2"] = _logprobs_and_grads(load_policy(smollm2_student_path, "float64").train(), mb, share=False)
    lp_exact, grad_exact = _EXACT["smollm2"]
    _assert_no_less_accurate([lp_shared], [lp_plain], [lp_exact])
    _assert_no_less_accurate(grad_shared, grad_plain, grad_exact)
