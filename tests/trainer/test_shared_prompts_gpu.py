"""trainer.share_prompts on a CUDA GPU (skipped without one): the branches' attention
(`causal_lower_right` masks through SDPA's CUDA kernels) gives the plain packed forward's
log-probs and gradients, in float32 and in bfloat16, on a model of SmolLM2-135M's shape (30 layers,
grouped-query attention 9 over 3 heads; random weights: the real checkpoint does not travel to a
GPU machine). tests/trainer/test_shared_prompts.py holds the CPU cases and the real weights.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_orch.memory.shapes import KNOWN_CONFIGS
from rlhf_orch.trainer.forward import packed_attention_impl, sequence_logprobs
from rlhf_orch.trainer import shared_prompts
from rlhf_orch.trainer.shared_prompts import BatchedBlockAttention, BranchLoopAttention, shared_prompt_layout
from rlhf_orch.transfer.batch import PackedBatch, Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def smollm2_shape():
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in KNOWN_CONFIGS["SmolLM2-135M-Instruct.Q4_1.gguf"].items() if k != "torch_dtype"}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=packed_attention_impl("cuda"))
    model.config.use_cache = False
    return model.train()


def _micro_batch(vocab: int) -> PackedBatch:
    """Three prompts (97, 64 and 40 tokens) with 4, 3 and 1 samples of 1-70 tokens, interleaved."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (97, 64, 40)]
    plan = [(0, 70), (1, 12), (2, 33), (0, 1), (1, 45), (0, 28), (1, 64), (0, 9)]
    return PackedBatch.from_samples(
        [
            Sample(prompt_ids=prompts[p], response_ids=torch.randint(3, vocab, (n,), generator=g), reward=0.0, index=i)
            for i, (p, n) in enumerate(plan)
        ]
    ).to("cuda")


@pytest.fixture(params=[BatchedBlockAttention, BranchLoopAttention], ids=["batched_blocks", "branch_loop"])
def attention(request, monkeypatch):
    """CUDA's default (batched blocks) and the loop (CPU's default, valid on any device)."""
    monkeypatch.setitem(shared_prompts.ATTENTION_BY_DEVICE, "cuda", request.param)
    return request.param


def _logprobs_and_grads(model, mb, share: bool):
    model.zero_grad(set_to_none=True)
    lp = sequence_logprobs(model, mb, 0.7, share_prompts=share)
    weights = torch.linspace(0.5, 1.5, lp.numel(), device="cuda")
    (lp.float() * weights * mb.action_mask).sum().backward()
    return lp.detach().float(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_float32_on_cuda_matches_the_plain_forward(smollm2_shape, attention):
    if smollm2_shape.config._attn_implementation != "varlen_sdpa":
        pytest.skip("sharing needs varlen_sdpa")
    model = smollm2_shape.float()
    mb = _micro_batch(model.config.vocab_size)
    assert shared_prompt_layout(mb).num_tokens < 0.7 * mb.num_tokens
    lp_plain, grad_plain = _logprobs_and_grads(model, mb, share=False)
    lp_shared, grad_shared = _logprobs_and_grads(model, mb, share=True)
    assert (lp_plain[mb.action_mask.bool()] < 0).all()
    torch.testing.assert_close(lp_shared, lp_plain, atol=2e-4, rtol=0)
    torch.testing.assert_close(grad_shared, grad_plain, atol=2e-4, rtol=2e-3)


def test_bfloat16_on_cuda_is_as_close_to_float32_as_the_plain_forward(smollm2_shape, attention):
    """bf16 rounds differently in the two rows, so the check is against float32: the shared row's
    error must be of the plain row's size, not larger."""
    if smollm2_shape.config._attn_implementation != "varlen_sdpa":
        pytest.skip("sharing needs varlen_sdpa")
    model = smollm2_shape.float()
    mb = _micro_batch(model.config.vocab_size)
    scored = mb.action_mask.bool()
    reference, _ = _logprobs_and_grads(model, mb, share=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model = model.to(torch.bfloat16)
    try:
        lp_plain, _ = _logprobs_and_grads(model, mb, share=False)
        lp_shared, _ = _logprobs_and_grads(model, mb, share=True)
    finally:  # the module's model back to its float32 weights, not their bf16 rounding
        model.float().load_state_dict(weights)
    plain_err = (lp_plain - reference)[scored].abs()
    shared_err = (lp_shared - reference)[scored].abs()
    assert plain_err.max() > 0  # bf16 did round
    assert shared_err.mean() <= 1.5 * plain_err.mean() + 1e-3, (shared_err.mean().item(), plain_err.mean().item())
    assert shared_err.max() <= 2.0 * plain_err.max() + 1e-2, (shared_err.max().item(), plain_err.max().item())
