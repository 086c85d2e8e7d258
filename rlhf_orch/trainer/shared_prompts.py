"""One forward over a shared prompt: a packed micro-batch whose sequences repeat a prompt (GRPO's
samples of one question, RLOO's, DAPO's...) holds that prompt once.

A packed micro-batch is one row of whole sequences, prompt and response each. The samples of a
group share their prompt token for token, so its keys, values and hidden states are the same in
every copy: the row here keeps the prompt once and puts each sample's response after it (its
position ids continue from the prompt's length), and each response attends to the prompt and to
itself (`shared_prompt_attention`). Every original position reads its hidden state from the row
(`model_position`); gradients of the prompt's copies add up in its one copy -- the same sums the
separate copies make, so log-probs, values and gradients equal the unshared forward's up to
float rounding (tests/test_shared_prompts.py).

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
    plain packed row is then as short). Sequences share when the tokens up to the one predicting
    their first model token are identical, wherever they sit in the micro-batch."""
    bounds = mb.cu_seqlens.tolist()
    ids = mb.input_ids.tolist()
    first_action = _first_action_offsets(mb)
    groups: dict[object, list[int]] = {}
    for b, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
        offset = first_action[b]
        # A sequence without model tokens shares nothing (its own key).
        key = tuple(ids[a:a + offset + 1]) if offset is not None else ("alone", b)
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
        row += ids[a:a + prefix]
        positions += range(prefix)
        branches = []
        for b in members:
            a, z = bounds[b], bounds[b + 1]
            model_position[a:a + prefix] = torch.arange(start, start + prefix)
            if len(members) > 1:
                length = z - a - prefix
                model_position[a + prefix:z] = torch.arange(len(row), len(row) + length)
                row += ids[a + prefix:z]
                positions += range(prefix, prefix + length)
                branches.append(length)
        segments.append(Segment(start, prefix, tuple(branches)))
    device = mb.input_ids.device
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


def shared_prompt_attention(query: Tensor, key: Tensor, value: Tensor, segments: tuple[Segment, ...],
                            scale: float | None, dropout_p: float) -> Tensor:
    """Attention over a shared-prompt row (`[1, heads, M, head_dim]` each, keys and values already
    repeated for grouped-query heads): each prefix causally, each branch over its prefix and
    itself (causal, aligned to the bottom right: its j-th token sees the prefix and its first j+1)."""
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for seg in segments:
        p0, p1 = seg.start, seg.start + seg.prefix
        outs.append(F.scaled_dot_product_attention(query[:, :, p0:p1], key[:, :, p0:p1], value[:, :, p0:p1],
                                                   dropout_p=dropout_p, is_causal=True, scale=scale))
        b0 = p1
        for length in seg.branches:
            b1 = b0 + length
            keys = torch.cat([key[:, :, p0:p1], key[:, :, b0:b1]], dim=2)
            values = torch.cat([value[:, :, p0:p1], value[:, :, b0:b1]], dim=2)
            outs.append(F.scaled_dot_product_attention(query[:, :, b0:b1], keys, values, dropout_p=dropout_p, scale=scale,
                                                       attn_mask=causal_lower_right(length, seg.prefix + length)))
            b0 = b1
    return torch.cat(outs, dim=2)
