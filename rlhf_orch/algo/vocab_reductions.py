"""Token log-probabilities and entropies of `[N, V]` logits without keeping float32 `[N, V]` copies
for the backward pass.

Written plainly with autograd, `log_softmax(z)[token]` keeps a float32 copy of every chunk of logits
and the entropy `logsumexp(z) - sum softmax(z) * z` keeps four (17 bytes per logit with its mask):
at 16k tokens and a 152k vocabulary that is 10 and 42 GB per micro-batch. Both are reductions over
the vocabulary whose gradients need only the logits and a few floats per row, so these autograd
functions keep exactly that -- the logits tensor the model already holds, the row's max and logsumexp
(and, for the entropy, the row's expected logit) -- and recompute softmax chunk by chunk in the backward.
The peak extra memory either way is one chunk of `max_chunk_elements` floats. (What fused kernels
such as flash-attn's cross-entropy do, in plain PyTorch.)

With z = logits / T, p = softmax(z), H = logsumexp(z) - E_p[z]:
    d logp(token) / d logits = (onehot(token) - p) / T
    d H / d logits           = -p * (z - E_p[z]) / T
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

#: The temperature that leaves the logits as the model gives them (logits / 1).
PLAIN_TEMPERATURE = 1.0
#: float32 elements of the largest chunk of rows processed at once (forward and backward).
CHUNK_ELEMENTS = 1 << 24


def _rows(vocab: int, max_chunk_elements: int) -> int:
    return max(1, max_chunk_elements // vocab)


#: A temperature for all rows, or one per row (float32 `[N]`: tokens sampled at different ones,
#: an agent's calls with their own settings).
Temperature = float | Tensor


def _rows_of(temperature: Temperature, chunk: slice) -> Temperature:
    """The temperature of a chunk's rows: the float, or the chunk's slice of the per-row ones."""
    return temperature[chunk] if isinstance(temperature, Tensor) else temperature


def _relative(chunk: Tensor, temperature: Temperature, shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(z, shift): the chunk's rows in float32 relative to their max logit (or `shift`), divided by
    the temperature (one, or the rows' own) -- shifted first, so large logits lose no digits to the
    division or to a difference of two large logsumexps. Rows of -inf only are left unshifted."""
    x = chunk.float()
    if shift is None:
        top = x.amax(dim=-1)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    z = x - shift.unsqueeze(-1)
    if isinstance(temperature, Tensor):
        return z / temperature.unsqueeze(-1), shift
    return (z / temperature if temperature != 1.0 else z), shift


def _chunked_gradient(
    logits: Tensor,
    shift: Tensor,
    lse: Tensor,
    grad: Tensor,
    temperature: Temperature,
    rows: int,
    local: Callable[[Tensor, Tensor, slice], Tensor],
) -> Tensor:
    """The gradient of a per-row reduction w.r.t. the logits, chunk by chunk: softmax recomputed from
    the saved shift and logsumexp, `local(p, z, rows)` the reduction's derivative w.r.t. z (it may
    overwrite p), times the incoming gradient / T (z = logits / T), cast to the logits' dtype."""
    out = torch.empty_like(logits)
    for start in range(0, logits.shape[0], rows):
        chunk = slice(start, start + rows)
        t = _rows_of(temperature, chunk)
        z, _ = _relative(logits[chunk], t, shift[chunk])
        p = torch.exp(z - lse[chunk].unsqueeze(-1))
        g = local(p, z, chunk).mul_((grad[chunk] / t).unsqueeze(-1))
        out[chunk] = g.to(out.dtype)
    return out


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: Temperature, max_chunk_elements: int) -> Tensor:
        rows = _rows(logits.shape[-1], max_chunk_elements)
        out, shifts, lse = [], [], []
        for start in range(0, logits.shape[0], rows):
            z, shift = _relative(logits[start : start + rows], _rows_of(temperature, slice(start, start + rows)))
            row_lse = torch.logsumexp(z, dim=-1)
            out.append(z.gather(-1, tokens[start : start + rows].unsqueeze(-1)).squeeze(-1) - row_lse)
            shifts.append(shift)
            lse.append(row_lse)
        ctx.save_for_backward(logits, tokens, torch.cat(shifts), torch.cat(lse))
        ctx.temperature, ctx.rows = temperature, rows
        return torch.cat(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        logits, tokens, shift, lse = ctx.saved_tensors

        def onehot_minus_p(p: Tensor, z: Tensor, chunk: slice) -> Tensor:
            picked = tokens[chunk].unsqueeze(-1)
            return p.neg_().scatter_add_(-1, picked, torch.ones_like(picked, dtype=p.dtype))

        return _chunked_gradient(logits, shift, lse, grad, ctx.temperature, ctx.rows, onehot_minus_p), None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: Temperature, max_chunk_elements: int) -> Tensor:
        rows = _rows(logits.shape[-1], max_chunk_elements)
        entropies, shifts, lse, mean_logit = [], [], [], []
        for start in range(0, logits.shape[0], rows):
            # H is shift-invariant: relative to the row's max, logsumexp and E_p[z] stay small, so
            # their difference loses no digits when logits are large (the backward works relative too).
            z, shift = _relative(logits[start : start + rows], _rows_of(temperature, slice(start, start + rows)))
            row_lse = torch.logsumexp(z, dim=-1, keepdim=True)
            p = torch.exp(z - row_lse)
            expected = (p * torch.where(p > 0, z, torch.zeros_like(z))).sum(dim=-1, keepdim=True)  # -inf logits add 0
            entropies.append((row_lse - expected).squeeze(-1))
            shifts.append(shift)
            lse.append(row_lse.squeeze(-1))
            mean_logit.append(expected.squeeze(-1))
        ctx.save_for_backward(logits, torch.cat(shifts), torch.cat(lse), torch.cat(mean_logit))
        ctx.temperature, ctx.rows = temperature, rows
        return torch.cat(entropies)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        logits, shift, lse, mean_logit = ctx.saved_tensors

        def minus_p_times_centred(p: Tensor, z: Tensor, chunk: slice) -> Tensor:
            centred = torch.where(p > 0, z - mean_logit[chunk].unsqueeze(-1), torch.zeros_like(z))  # -inf logits: 0
            return p.mul_(centred).neg_()

        return _chunked_gradient(logits, shift, lse, grad, ctx.temperature, ctx.rows, minus_p_times_centred), None, None


def _per_row(temperature: Temperature, rows_shape: torch.Size) -> Temperature:
    """A float as a float; per-position temperatures (`[...]` like the rows) flattened, float32."""
    if not isinstance(temperature, Tensor):
        return float(temperature)
    if temperature.shape != rows_shape:
        raise ValueError(f"temperatures {tuple(temperature.shape)} must match the rows {tuple(rows_shape)}")
    return temperature.detach().reshape(-1).float()


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: Temperature = PLAIN_TEMPERATURE,
    max_chunk_elements: int = CHUNK_ELEMENTS,
) -> Tensor:
    """`log softmax(logits / temperature)[token]`, `[..., V]`, `[...]` -> float32 `[...]`; `temperature`
    one for all, or per position (`[...]`)."""
    vocab = logits.shape[-1]
    if tokens.numel() == 0:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    flat = _TokenLogprobs.apply(
        logits.reshape(-1, vocab),
        tokens.reshape(-1).long(),
        _per_row(temperature, logits.shape[:-1]),
        max_chunk_elements,
    )
    return flat.reshape(tokens.shape)


def entropy(
    logits: Tensor, temperature: Temperature = PLAIN_TEMPERATURE, max_chunk_elements: int = CHUNK_ELEMENTS
) -> Tensor:
    """Entropy of `softmax(logits / temperature)`, `[..., V]` -> float32 `[...]`; -inf logits add 0;
    `temperature` one for all, or per position (`[...]`)."""
    vocab = logits.shape[-1]
    if logits.numel() == 0:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    flat = _Entropy.apply(logits.reshape(-1, vocab), _per_row(temperature, logits.shape[:-1]), max_chunk_elements)
    return flat.reshape(logits.shape[:-1])
