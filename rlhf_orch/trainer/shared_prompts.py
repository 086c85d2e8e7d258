"""One forward over a shared prompt: a packed micro-batch whose sequences repeat a prompt (GRPO's
samples of one question, RLOO's, DAPO's...) holds that prompt once.

A packed micro-batch is one row of whole sequences, prompt and response each. The samples of a
group share their prompt token for token, so its keys, values and hidden states are the same in
every copy: the row here keeps the prompt once and puts each sample's response after it (its
position ids continue from the prompt's length), and each response attends to the prompt and to
itself (`shared_prompt_attention`). Every original position reads its hidden state from the row
(`model_position`); gradients of the prompt's copies add up in its one copy -- the same sums the
separate copies make, so log-probs, values and gradients equal the unshared forward's up to
float rounding (tests/trainer/test_shared_prompts.py).

What it saves is the prompt's share of the compute: on SmolLM2 with 102-token few-shot prompts,
8 samples of ~10 tokens, 3600 tokens become ~730 (docs/benchmarks.md). A sequence's "prompt" here
is everything up to the token that predicts its first model token (multi-turn trajectories share
their first prompt; later turns are in the branch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_orch.transfer.batch import PackedBatch


@dataclass(frozen=True)
class Segment:
    """A span of the row: `prefix` tokens attended causally (a shared prompt, or a whole sequence
    nobody shares with), then `branches` (response lengths), each attending to the prefix and to
    itself causally."""

    start: int
    prefix: int
    branches: tuple[int, ...] = ()


@dataclass
class SharedPromptLayout:
    """The row the model runs on and where each of the micro-batch's positions is in it."""

    input_ids: Tensor  # [M]
    position_ids: Tensor  # [M]
    segments: tuple[Segment, ...]
    model_position: Tensor  # [N] long: the row position holding original position t's token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def shared_prompt_layout(mb: PackedBatch) -> SharedPromptLayout | None:
    """The shared-prompt row of `mb`, or None when no two of its sequences share a prompt (the
    plain packed row is then as short) or the row saves less than the device's attention needs to
    pay (`min_token_saving`). Sequences share when the tokens up to the one predicting their first
    model token are identical, wherever they sit in the micro-batch."""
    bounds = mb.cu_seqlens.tolist()
    ids = mb.input_ids.tolist()
    first_action = _first_action_offsets(mb)
    groups: dict[object, list[int]] = {}
    for b, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
        offset = first_action[b]
        # A sequence without model tokens shares nothing (its own key).
        key = tuple(ids[a : a + offset + 1]) if offset is not None else ("alone", b)
        groups.setdefault(key, []).append(b)
    if len(groups) == len(bounds) - 1:
        return None
    row: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    model_position = torch.empty(len(ids), dtype=torch.long)
    for members in groups.values():
        start = len(row)
        first = members[0]
        a, z = bounds[first], bounds[first + 1]
        prefix = (first_action[first] + 1) if len(members) > 1 else z - a
        row += ids[a : a + prefix]
        positions += range(prefix)
        branches = []
        for b in members:
            a, z = bounds[b], bounds[b + 1]
            model_position[a : a + prefix] = torch.arange(start, start + prefix)
            if len(members) > 1:
                length = z - a - prefix
                model_position[a + prefix : z] = torch.arange(len(row), len(row) + length)
                row += ids[a + prefix : z]
                positions += range(prefix, prefix + length)
                branches.append(length)
        segments.append(Segment(start, prefix, tuple(branches)))
    device = mb.input_ids.device
    if len(row) > (1.0 - _attention_class(device).min_token_saving) * len(ids):
        return None
    return SharedPromptLayout(
        input_ids=torch.tensor(row, dtype=mb.input_ids.dtype, device=device),
        position_ids=torch.tensor(positions, dtype=torch.long, device=device),
        segments=tuple(segments),
        model_position=model_position.to(device),
    )


def _first_action_offsets(mb: PackedBatch) -> list[int | None]:
    """Per sequence, the offset of its first position that predicts a model token (None: none)."""
    bounds = mb.cu_seqlens.tolist()
    actions = mb.action_mask.bool().nonzero().flatten().tolist()
    out: list[int | None] = [None] * (len(bounds) - 1)
    b = 0
    for t in actions:  # ascending
        while t >= bounds[b + 1]:
            b += 1
        if out[b] is None:
            out[b] = t - bounds[b]
    return out


class BranchLoopAttention:
    """Attention over a shared-prompt row, one SDPA call per prefix and per branch: no padding, so
    the least arithmetic -- the choice where each call's overhead is small next to its work (CPU)."""

    # Any shorter row pays on CPU: 2.0-2.7x per update at 60-70 % fewer tokens, 1.1x at 19 %
    # (scripts/bench/bench_shared_prompts.py on SmolLM2's shape, docs/benchmarks.md "GPU runs").
    min_token_saving = 0.0

    def __init__(self, segments: tuple[Segment, ...]):
        self.segments = segments

    @classmethod
    def of(cls, layout: SharedPromptLayout) -> "BranchLoopAttention":
        return cls(layout.segments)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, dropout_p: float) -> Tensor:
        return shared_prompt_attention(query, key, value, self.segments, scale, dropout_p)


class BatchedBlockAttention:
    """The same attention in two SDPA calls per layer: every prefix (and unshared sequence) padded
    into one batch, every branch with its prefix's keys in another, with per-row masks. On a GPU one
    call per branch is launch-bound: at 4 prompts x 8 samples x 24 layers the loop costs more than
    the prompt's recomputation saves (docs/benchmarks.md "GPU runs"); padding wastes only
    arithmetic the GPU has to spare. The gathers' indices and masks are built once per micro-batch."""

    # The masked kernel is slower per score than the plain row's causal one and pads every branch to
    # the longest: measured on an H200, 19 % fewer tokens (long answers) ran 0.65x, 29-68 % fewer
    # 1.21-1.39x (docs/benchmarks.md "GPU runs"). Below a quarter saved, the plain row runs.
    min_token_saving = 0.25

    def __init__(self, segments: tuple[Segment, ...], num_tokens: int, device: torch.device):
        prefixes = [(0, 0, seg.start, seg.prefix) for seg in segments]
        branches = []
        for seg in segments:
            b0 = seg.start + seg.prefix
            for length in seg.branches:  # >= 1 token each: a sequence without model tokens shares nothing
                branches.append((seg.start, seg.prefix, b0, length))
                b0 += length
        self.batches = [_BlockBatch.of(blocks, device) for blocks in (prefixes, branches) if blocks]
        order = torch.cat([b.query_positions for b in self.batches])
        if order.numel() != num_tokens:
            raise ValueError(f"shared-prompt blocks cover {order.numel()} of the row's {num_tokens} positions")
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(order.numel(), device=device)

    @classmethod
    def of(cls, layout: SharedPromptLayout) -> "BatchedBlockAttention":
        return cls(layout.segments, layout.num_tokens, layout.input_ids.device)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, scale: float | None, dropout_p: float) -> Tensor:
        q, k, v = query[0], key[0], value[0]  # [heads, M, head_dim]
        outs = []
        for batch in self.batches:
            out = F.scaled_dot_product_attention(
                q[:, batch.query_index].transpose(0, 1),
                k[:, batch.key_index].transpose(0, 1),
                v[:, batch.key_index].transpose(0, 1),
                attn_mask=batch.mask,
                dropout_p=dropout_p,
                scale=scale,
            )
            outs.append(out.transpose(0, 1)[:, batch.query_valid])  # [heads, valid queries, head_dim]
        return torch.cat(outs, dim=1)[:, self.inverse].unsqueeze(0)


@dataclass
class _BlockBatch:
    """Blocks (context start, context length, own start, own length) padded into one batch: block b's
    queries are its own tokens, its keys its context then its own tokens, causal to the lower right."""

    query_index: Tensor  # [B, Q] row positions (padding: 0)
    key_index: Tensor  # [B, K]
    mask: Tensor  # [B, 1, Q, K] bool: may attend
    query_valid: Tensor  # [B, Q] bool
    query_positions: Tensor  # [valid queries] row positions, in query_valid's order

    @classmethod
    def of(cls, blocks: list[tuple[int, int, int, int]], device: torch.device) -> "_BlockBatch":
        ctx_start, ctx_len, own_start, own_len = (torch.tensor(col).view(-1, 1) for col in zip(*blocks))
        # Multiples of 16 keep SDPA's fused GPU kernels usable with a mask.
        q_len = _round_up(int(own_len.max()), 16)
        k_len = _round_up(int((ctx_len + own_len).max()), 16)
        i = torch.arange(q_len).view(1, -1)
        j = torch.arange(k_len).view(1, -1)
        query_valid = i < own_len
        query_index = torch.where(query_valid, own_start + i, 0)
        key_index = torch.where(
            j < ctx_len, ctx_start + j, torch.where(j < ctx_len + own_len, own_start + j - ctx_len, 0)
        )
        mask = j.unsqueeze(1) <= ctx_len.unsqueeze(2) + i.unsqueeze(2)  # causal, lower right
        mask &= (j < ctx_len + own_len).unsqueeze(1)
        # A padded query row keeps one key, so SDPA's softmax has no all-masked row (its output is dropped).
        mask |= (~query_valid).unsqueeze(2) & (j == 0).unsqueeze(1)
        return cls(
            query_index.to(device),
            key_index.to(device),
            mask.unsqueeze(1).to(device),
            query_valid.to(device),
            query_index[query_valid].to(device),
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Per device type, the attention a shared-prompt row runs with (others: BranchLoopAttention).
ATTENTION_BY_DEVICE: dict[str, type] = {"cuda": BatchedBlockAttention}


def _attention_class(device: torch.device) -> type:
    return ATTENTION_BY_DEVICE.get(device.type, BranchLoopAttention)


def attention_for(layout: SharedPromptLayout) -> BranchLoopAttention | BatchedBlockAttention:
    return _attention_class(layout.input_ids.device).of(layout)


def shared_prompt_attention(
    query: Tensor, key: Tensor, value: Tensor, segments: tuple[Segment, ...], scale: float | None, dropout_p: float
) -> Tensor:
    """Attention over a shared-prompt row (`[1, heads, M, head_dim]` each, keys and values already
    repeated for grouped-query heads): each prefix causally, each branch over its prefix and
    itself (causal, aligned to the bottom right: its j-th token sees the prefix and its first j+1)."""
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for seg in segments:
        p0, p1 = seg.start, seg.start + seg.prefix
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, p0:p1],
                key[:, :, p0:p1],
                value[:, :, p0:p1],
                dropout_p=dropout_p,
                is_causal=True,
                scale=scale,
            )
        )
        b0 = p1
        for length in seg.branches:
            b1 = b0 + length
            keys = torch.cat([key[:, :, p0:p1], key[:, :, b0:b1]], dim=2)
            values = torch.cat([value[:, :, p0:p1], value[:, :, b0:b1]], dim=2)
            outs.append(
                F.scaled_dot_product_attention(
                    query[:, :, b0:b1],
                    keys,
                    values,
                    dropout_p=dropout_p,
                    scale=scale,
                    attn_mask=causal_lower_right(length, seg.prefix + length),
                )
            )
            b0 = b1
    return torch.cat(outs, dim=2)
