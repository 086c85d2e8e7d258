"""Losses and loss aggregation against hand-computed numbers (the arithmetic is in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_orch.algo.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_weights,
    clipped_policy_loss,
    clipped_value_loss,
    decoupled_is_weights,
    entropy_from_logits,
    kl_divergence,
    loss_denominator,
    truncated_is_weights,
)

NAN, INF = float("nan"), float("inf")


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-6):
    expected = expected if torch.is_tensor(expected) else t(expected)
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------- aggregation
# Ragged rows (pads hold NaN): row sums 6, 4, 11 and an empty row; 6 tokens, 3 non-empty rows.
RAGGED_LOSS = t([[1, 2, 3], [4, NAN, NAN], [5, 6, NAN], [NAN, NAN, NAN]])
RAGGED_MASK = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])


def test_aggregation_modes_on_ragged_rows_by_hand():
    agg = lambda mode, **kw: aggregate_loss(RAGGED_LOSS, RAGGED_MASK, mode, **kw)  # noqa: E731
    close(agg("token-mean"), 21 / 6)  # (1+2+3+4+5+6) / 6 = 3.5
    close(agg("seq-mean-token-sum"), 7.0)  # (6 + 4 + 11) / 3; the empty row is not a sequence
    close(agg("seq-mean-token-mean"), 11.5 / 3)  # (6/3 + 4/1 + 11/2) / 3 = (2 + 4 + 5.5) / 3
    # Dr. GRPO: sum / (sequences * norm_len); norm_len defaults to the width T = 3 -> 21 / 9.
    # (veRL's agg_loss returns 21 / 3 = 7 here: it does not divide by the number of sequences.)
    close(agg("seq-mean-token-sum-norm"), 21 / 9)
    close(agg("seq-mean-token-sum-norm", norm_len=7), 1.0)  # 21 / (3 * 7)
    # The pieces: weights and denominators.
    close(
        aggregation_weights(RAGGED_MASK, "seq-mean-token-mean"),
        [[1 / 3, 1 / 3, 1 / 3], [1, 0, 0], [0.5, 0.5, 0], [0, 0, 0]],
    )
    close(loss_denominator(RAGGED_MASK, "token-mean"), 6.0)
    close(loss_denominator(RAGGED_MASK, "seq-mean-token-sum"), 3.0)
    close(loss_denominator(RAGGED_MASK, "seq-mean-token-sum-norm", norm_len=7), 21.0)


def _packed(loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of `RAGGED_*` as one flat packed row: each row's real positions plus one padding
    position per row (a packed sequence's prompt), with the sequence id of every position."""
    losses, masks, ids = [], [], []
    for row, (row_loss, m) in enumerate(zip(loss, mask)):
        keep = m.bool()
        losses += [row_loss[keep], t([NAN])]
        masks += [m[keep], t([0])]
        ids.append(torch.full((int(keep.sum()) + 1,), row))
    return torch.cat(losses), torch.cat(masks), torch.cat(ids)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_packed_rows_aggregate_like_padded_rows(mode):
    # The default transfer hands the trainer flat [N] micro-batches: every seq-mean must still see
    # one sequence per packed sequence, not one per micro-batch.
    flat_loss, flat_mask, ids = _packed(RAGGED_LOSS, RAGGED_MASK)
    padded = aggregate_loss(RAGGED_LOSS, RAGGED_MASK, mode, norm_len=7)
    close(aggregate_loss(flat_loss, flat_mask, mode, norm_len=7, sequence_ids=ids), padded)
    close(loss_denominator(flat_mask, mode, 7, ids), loss_denominator(RAGGED_MASK, mode, 7))
    weights = aggregation_weights(flat_mask, mode, sequence_ids=ids)
    close(weights[flat_mask.bool()], aggregation_weights(RAGGED_MASK, mode)[RAGGED_MASK.bool()])
    # The padded layout's own sequence ids (its rows) change nothing.
    rows = torch.arange(4)[:, None].expand(4, 3)
    close(aggregate_loss(RAGGED_LOSS, RAGGED_MASK, mode, norm_len=7, sequence_ids=rows), padded)


@pytest.mark.parametrize("mode", [m for m in LOSS_AGGREGATIONS if m != "token-mean"])
def test_a_flat_mask_without_sequence_ids_is_refused_for_seq_means(mode):
    flat_loss, flat_mask, _ = _packed(RAGGED_LOSS, RAGGED_MASK)
    with pytest.raises(ValueError, match="sequence_ids"):
        aggregate_loss(flat_loss, flat_mask, mode, norm_len=7)


def test_dual_clip_bounds_negative_advantages_by_hand():
    # clip 0.2, clip_ratio_c = 3; logp_old = 0, logp = ln(ratio):
    #   r=5,   A=-1: max(5, 1.2) = 5 -> min(5, 3) = 3    dual-clipped (no gradient)
    #   r=2,   A=-1: max(2, 1.2) = 2 -> min(2, 3) = 2    kept
    #   r=5,   A=+1: max(-5, -1.2) = -1.2                 the dual clip is for A < 0 only
    #   r=0.5, A=-2: max(1, 1.6) = 1.6 -> min(1.6, 6) = 1.6
    logp = torch.log(t([[5.0, 2.0, 5.0, 0.5]])).requires_grad_()
    adv = t([[-1.0, -1.0, 1.0, -2.0]])
    loss_mat, stats = clipped_policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), 0.2, 0.2, clip_ratio_c=3.0)
    close(loss_mat, [[3.0, 2.0, -1.2, 1.6]])
    close(stats["clipfrac_dual"], 0.25)
    loss_mat.sum().backward()
    close(logp.grad, [[0.0, 2.0, 0.0, 0.0]])  # d(-A r)/d logp = -A r = 2 for the kept token
    unbounded, stats = clipped_policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), 0.2, 0.2)
    assert "clipfrac_dual" not in stats and float(unbounded[0, 0]) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        clipped_policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_ratio_c=1.0)


def test_value_clip_counts_no_rounding_tie_as_clipped():
    # Every V within eps of V_old: nothing is clipped. In bf16, V_old + (V - V_old) rounds away
    # from V for ~4 % of these values, and that rounding used to count as "clipped" (and to pick
    # the rounded term, with no gradient) although nothing was clipped.
    gen = torch.Generator().manual_seed(0)
    old = torch.sign(torch.randn(4096, generator=gen)) * 10 ** (torch.rand(4096, generator=gen) * 9 - 8)
    values = (old + (torch.rand(4096, generator=gen) - 0.5) * 0.39).to(torch.bfloat16)  # |V - V_old| < 0.2
    old, returns = old.to(torch.bfloat16), (torch.randn(4096, generator=gen) * 3).to(torch.bfloat16)
    loss_mat, stats = clipped_value_loss(values, old, returns, torch.ones(4096), clip_eps=0.2)
    assert float(stats["vf_clipfrac"]) == 0.0
    assert torch.equal(loss_mat, 0.5 * (values - returns) ** 2)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_of_nothing_is_zero(mode):
    out = aggregate_loss(RAGGED_LOSS, torch.zeros(4, 3), mode)
    assert torch.equal(out, torch.tensor(0.0))
    # An all-padding micro-batch with a global denominator also contributes exactly 0.
    assert torch.equal(aggregate_loss(RAGGED_LOSS, torch.zeros(4, 3), mode, denominator=5.0), torch.tensor(0.0))


def test_unknown_aggregation_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(RAGGED_LOSS, RAGGED_MASK, "sample-mean")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_micro_batches_with_global_denominator_sum_to_full_batch(mode):
    # One optimizer step of 9 rows over two "ranks", cut into micro-batches of 2, 1 | 4, 2 rows,
    # each trimmed to its own padded width (as a token-budget packer would).
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 6, 0, 1, 5, 2, 6, 4, 1])
    mask = (torch.arange(6).expand(9, 6) < lengths[:, None]).float()
    logits = torch.randn(9, 6, generator=gen, dtype=torch.float64).requires_grad_()
    loss_mat = torch.where(mask.bool(), logits**2, torch.full_like(logits, NAN))
    full = aggregate_loss(loss_mat, mask, mode, norm_len=6)
    (grad_full,) = torch.autograd.grad(full, logits, retain_graph=True)

    cuts = [(0, 2), (2, 3), (3, 7), (7, 9)]
    micro = []
    for lo, hi in cuts:
        width = max(int(lengths[lo:hi].max()), 1)
        micro.append((loss_mat[lo:hi, :width], mask[lo:hi, :width]))
    # Step 1: the global denominator = sum of every micro-batch's contribution on every rank.
    denominator = sum(loss_denominator(m, mode, norm_len=6) for _, m in micro)
    # Step 2: each micro-batch's loss with that denominator; their sum is the full-batch loss.
    micro_losses = [aggregate_loss(lm, m, mode, denominator=denominator) for lm, m in micro]
    total = sum(micro_losses)
    (grad_micro,) = torch.autograd.grad(total, logits)
    close(total, full, atol=1e-12)
    close(grad_micro, grad_full, atol=1e-12)
    assert torch.isfinite(grad_micro).all()
    # Data parallel with gradient averaging over W ranks: each rank scales its losses by W.
    world = 2
    rank_losses = [sum(micro_losses[:2]), sum(micro_losses[2:])]  # rank 0: 3 rows, rank 1: 6
    close(sum(world * r for r in rank_losses) / world, full, atol=1e-12)


# --------------------------------------------------------------------------- policy loss
def test_decoupled_clip_by_hand():
    # clip_low = 0.2, clip_high = 0.28 -> ratio clipped to [0.8, 1.28]; logp_old = 0, logp = ln r
    #   r=1.5,  A=+1: max(-1.5, -1.28) = -1.28  clipped (high)
    #   r=1.25, A=+1: inside [0.8, 1.28]: -1.25  (with a symmetric 0.2 it would be clipped to -1.2)
    #   r=0.5,  A=-1: max( 0.5,  0.8)  =  0.8   clipped (low)
    #   r=0.5,  A=+1: max(-0.5, -0.8)  = -0.5
    #   r=1.5,  A=-1: max( 1.5,  1.28) =  1.5
    #   r=0.85, A=-1: inside: 0.85
    #   pad: logp -inf, A NaN -> 0
    # token-mean = (-1.28 - 1.25 + 0.8 - 0.5 + 1.5 + 0.85) / 6 = 0.12 / 6 = 0.02
    ratios = [1.5, 1.25, 0.5, 0.5, 1.5, 0.85]
    logp = torch.cat([torch.log(t([ratios])), t([[-INF]])], 1).requires_grad_()
    old = t([[0, 0, 0, 0, 0, 0, -INF]])
    adv = t([[1, 1, -1, 1, -1, -1, NAN]])
    mask = t([[1, 1, 1, 1, 1, 1, 0]])
    loss_mat, stats = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss_mat, [[-1.28, -1.25, 0.8, -0.5, 1.5, 0.85, 0.0]])
    close(aggregate_loss(loss_mat, mask, "token-mean"), 0.02)
    close(stats["clipfrac"], 2 / 6)
    close(stats["clipfrac_high"], 1 / 6)
    close(stats["clipfrac_low"], 1 / 6)
    close(stats["ratio_mean"], 6.1 / 6)  # (1.5 + 1.25 + 0.5 + 0.5 + 1.5 + 0.85) / 6
    # approx_kl = mean((r - 1) - ln r): 1.5 -> 0.094535, 1.25 -> 0.026856, 0.5 -> 0.193147,
    #   0.85 -> 0.012519; (2*0.094535 + 0.026856 + 2*0.193147 + 0.012519) / 6 = 0.102457
    close(stats["approx_kl"], 0.102457)
    # d loss_t / d logp_t = -A r for unclipped tokens, 0 for clipped ones and the pad.
    aggregate_loss(loss_mat, mask, "seq-mean-token-sum").backward()  # one row: plain sum
    close(logp.grad, [[0.0, -1.25, 0.0, -0.5, 1.5, 0.85, 0.0]])


def test_tis_weights_scale_the_token_loss():
    # r = 1 (logp = old), A = [2, -1]: surrogate loss [-2, 1]; TIS weights [0.5, 2] -> [-1, 2].
    # The pad's NaN weight does not leak.
    logp = t([[0.0, 0.0, 0.0]])
    adv = t([[2.0, -1.0, 0.0]])
    mask = t([[1, 1, 0]])
    loss_mat, _ = clipped_policy_loss(logp, logp, adv, mask, is_weights=t([[0.5, 2.0, NAN]]))
    close(loss_mat, [[-1.0, 2.0, 0.0]])


def test_truncated_is_weights_cap():
    # old / behaviour: 0.5/0.25 = 2 (= cap), 0.2/0.4 = 0.5, 0.9/0.1 = 9 -> cap 2, 0.6/0.4 = 1.5;
    # pad (behaviour -inf) -> 0
    old = torch.log(t([[0.5, 0.2, 0.9, 0.6, 1.0]]))
    behaviour = torch.log(t([[0.25, 0.4, 0.1, 0.4, 0.0]]))
    mask = t([[1, 1, 1, 1, 0]])
    close(truncated_is_weights(old, behaviour, mask, cap=2.0), [[2.0, 0.5, 2.0, 1.5, 0.0]])
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, behaviour, mask, cap=0.0)


def test_decoupled_is_weights_drop_tokens_above_the_cap():
    # pi_prox / pi_behaviour: 0.5/0.25 = 2 (kept), 0.2/0.4 = 0.5 (kept), 0.9/0.1 = 9 > cap 5 ->
    # dropped (0, where TIS would give 5), 1/0.2 = 5 = cap (kept: only above the cap drops; the
    # log-ratio is exactly ln 5 in float32); pad (behaviour -inf, old NaN) -> 0; a hole in the
    # mask -> 0 though its weight is 1.5.
    old = torch.log(t([[0.5, 0.2, 0.9, 1.0, NAN, 0.6]]))
    behaviour = torch.log(t([[0.25, 0.4, 0.1, 0.2, 0.0, 0.4]]))
    mask = t([[1, 1, 1, 1, 0, 0]])
    close(decoupled_is_weights(old, behaviour, mask, cap=5.0), [[2.0, 0.5, 0.0, 5.0, 0.0, 0.0]], atol=1e-5)


def test_decoupled_is_weights_do_not_overflow():
    # Log-ratios of +-200 (exp(200) is inf in float32, and inf * 0 would be NaN in the loss): the
    # huge weight is dropped, the tiny one is a finite 0-ish weight, nothing is inf or NaN.
    old = t([[0.0, -200.0, -1.0]])
    behaviour = t([[-200.0, 0.0, -1.0]])
    weights = decoupled_is_weights(old, behaviour, t([[1, 1, 1]]), cap=5.0)
    assert torch.isfinite(weights).all()
    close(weights, [[0.0, 0.0, 1.0]])
    # Through the policy loss: the dropped token contributes neither loss nor gradient.
    logp = old.clone().requires_grad_(True)
    loss_mat, _ = clipped_policy_loss(logp, old, t([[1.0, 1.0, 1.0]]), t([[1, 1, 1]]), is_weights=weights)
    loss_mat.sum().backward()
    assert torch.isfinite(loss_mat).all() and torch.isfinite(logp.grad).all()
    close(loss_mat, [[0.0, 0.0, -1.0]])
    close(logp.grad, [[0.0, 0.0, -1.0]])


@pytest.mark.parametrize("cap", [1.0, 0.5, 0.0, NAN])
def test_decoupled_is_weights_cap_must_exceed_one(cap):
    # AReaL's bound: at a cap of 1 or below, an on-policy token (weight 1 up to float noise) could be dropped.
    with pytest.raises(ValueError, match="cap must be > 1"):
        decoupled_is_weights(t([[0.0]]), t([[0.0]]), t([[1]]), cap=cap)


# --------------------------------------------------------------------------- KL estimators
def test_kl_estimators_by_hand():
    # token 0: p = 0.5, p_ref = 0.25: logp - ref = ln 2 = 0.693147
    #   k1 = 0.693147; k2 = 0.5 * 0.480453 = 0.240227; k3: d = -ln 2, e^d - d - 1 = 0.193147
    # token 1: logp = ref: all 0
    # token 2: logp - ref = -0.5: k1 = -0.5; k2 = 0.125; k3: d = 0.5, e^0.5 - 1.5 = 0.148721
    # token 3: d = ref - logp = 2: k3 = e^2 - 3 = 4.389056 (inside the [-10, 10] clamp)
    logp = t([[math.log(0.5), -2.0, -1.0, -3.0]])
    ref = t([[math.log(0.25), -2.0, -0.5, -1.0]])
    close(kl_divergence(logp, ref, "k1"), [[0.693147, 0.0, -0.5, -2.0]])
    close(kl_divergence(logp, ref, "k2"), [[0.240227, 0.0, 0.125, 2.0]])
    close(kl_divergence(logp, ref, "k3"), [[0.193147, 0.0, 0.148721, 4.389056]], atol=1e-5)
    close(kl_divergence(logp, ref, "low_var_kl"), kl_divergence(logp, ref, "k3"))


def test_low_var_kl_clamps_like_verl_and_masks_padding():
    # d = -30 -> clamped to -20: e^-20 + 20 - 1 = 19 -> clamped to 10
    # d = +30 -> clamped to  20: e^20 - 21 (~4.85e8) -> clamped to 10
    logp = t([[0.0, -30.0, -1.0, -INF]]).requires_grad_()
    ref = t([[-30.0, 0.0, -1.0, -INF]])
    mask = t([[1, 1, 1, 0]])
    kl = kl_divergence(logp, ref, "low_var_kl", mask=mask)
    close(kl, [[10.0, 10.0, 0.0, 0.0]])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="k2"):
        kl_divergence(logp, ref, "k4")


# --------------------------------------------------------------------------- entropy
def test_entropy_from_logits():
    # Uniform over V = 7: H = ln 7 = 1.945910, also for huge equal logits (stability).
    close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    close(entropy_from_logits(torch.full((1, 7), 1e4)), [math.log(7)])
    # logits [0, ln 3] -> p = [0.25, 0.75]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.562335
    close(entropy_from_logits(t([[0.0, math.log(3.0)]])), [0.562335])
    # A masked-out vocabulary entry (-inf) counts as probability 0: [0, -inf, 0] -> ln 2.
    logits = t([[0.0, -INF, 0.0]]).requires_grad_()
    h = entropy_from_logits(logits)
    close(h, [math.log(2)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert entropy_from_logits(torch.zeros(3, 5, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7, "per_position"])
@pytest.mark.parametrize("chunk", [1 << 24, 120, 1])
def test_log_probs_and_entropy_gradients_match_plain_autograd(temperature, chunk):
    """`vocab_reductions` recomputes softmax by chunks in its backward instead of keeping it: the
    values and gradients of a weighted sum of log-probs and entropies equal float64 autograd on the
    plain formulas -- masked (-inf) vocabulary, logits near 1e4, one row per chunk or all at once;
    one temperature, or one per position (an agent's calls at their own, env.sampling=call)."""
    from rlhf_orch.algo.vocab_reductions import entropy, token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 13, 40) * 3
    if temperature == "per_position":
        temperature = torch.tensor([0.5, 1.0, 1.3]).repeat(3, 5)[:, :13]
    logits[0, 2, 5:9] = float("-inf")
    logits[1] += 1e4
    tokens = torch.randint(0, 5, (3, 13))
    w_lp, w_h = torch.randn(3, 13), torch.randn(3, 13)
    ours = logits.clone().requires_grad_()
    lp, h = token_logprobs(ours, tokens, temperature, chunk), entropy(ours, temperature, chunk)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    plain = logits.double().requires_grad_()
    scaled = plain / (temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature)
    log_p = torch.log_softmax(scaled, -1)
    ref_lp = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_h = -(log_p.exp() * torch.where(torch.isfinite(log_p), log_p, torch.zeros_like(log_p))).sum(-1)
    ((ref_lp * w_lp.double()).sum() + (ref_h * w_h.double()).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), ref_h.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours.grad.double(), plain.grad, atol=2e-6, rtol=1e-4)
    assert plain.grad.abs().max() > 0.1  # gradients that are not trivially zero


def test_the_trainer_s_forward_keeps_no_copy_of_the_logits_for_its_backward():
    """Padded micro-batches too: their `[:, :-1]` view of the logits is not contiguous, and
    flattening it would copy it -- the reductions run on the whole logits instead. Saved-tensor
    hooks see nothing of [T, V] size but the model's own logits."""
    from rlhf_orch.trainer.forward import sequence_logprobs_and_entropy
    from rlhf_orch.transfer.batch import PaddedBatch, Sample

    vocab = 300

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, vocab)

        def forward(self, input_ids, logits_to_keep, **_):  # as HF's causal LMs: the kept positions' logits
            return type("Out", (), {"logits": self.embed(input_ids[:, logits_to_keep])})()

    mb = PaddedBatch.from_samples(
        [
            Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], reward=0.0),
            Sample(prompt_ids=[1, 2], response_ids=[4, 5], reward=0.0),
        ],
        0,
    )
    big: list[int] = []

    def keep(t):
        if t.dim() >= 2 and t.shape[-1] == vocab and t.numel() >= 2 * 4 * vocab:  # the scored columns (1..5) of 2 rows
            big.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        lp, h = sequence_logprobs_and_entropy(Head(), mb, temperature=0.7)
    assert lp.shape == h.shape == (2, mb.input_ids.shape[1] - 1)
    assert len(set(big)) == 1, f"{len(set(big))} [T, V] tensors kept for the backward"
