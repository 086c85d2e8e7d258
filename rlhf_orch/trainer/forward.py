"""Forward passes on one micro-batch: next-token logprobs (policy, reference) and values (critic).

Two layouts, one code path:

* `PaddedBatch` -> `[b, L]` with an attention mask; outputs `[b, L-1]`.
* `PackedBatch` -> ONE row `[1, N]` holding every sequence back to back, `position_ids` restarting
  at 0 per sequence and `cu_seqlens` passed down to the attention as HF's varlen kwargs
  (`cu_seq_lens_q/k`, `max_length_q/k`). Outputs are `[N]`, aligned with `mb.action_mask`
  (position t = prediction of token t+1; each sequence's last position predicts nothing and is 0).

Attention never crosses a sequence boundary: the model is loaded with `packed_attention_impl()`,
which is flash-attention varlen on a CUDA machine that has `flash_attn`, and otherwise
`varlen_sdpa` (registered below): torch SDPA run causally on each `cu_seqlens` segment. That needs
no `[N, N]` mask -- at a 128k-token budget a block-diagonal mask alone would be 17 GB -- and costs
sum(L_i^2) like the kernels do. For padded batches `varlen_sdpa` is plain HF sdpa, so one model
object serves both layouts.
"""

from __future__ import annotations

from functools import singledispatch
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf_orch.algo.ppo_math import logprobs_from_logits
from rlhf_orch.trainer.shared_prompts import (
    BatchedBlockAttention,
    BranchLoopAttention,
    SharedPromptLayout,
    attention_for,
    shared_prompt_layout,
)
from rlhf_orch.transfer.batch import SAMPLING_TEMPERATURE, PackedBatch, PaddedBatch

VARLEN_SDPA = "varlen_sdpa"


# --------------------------------------------------------------------------- attention
def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    shared_prompt_attention: BranchLoopAttention | BatchedBlockAttention | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention interface. `query/key/value`: `[1, heads, N, head_dim]` when packed (a
    shared-prompt row: `shared_prompt_attention`, rlhf_orch.trainer.shared_prompts)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if shared_prompt_attention is not None:
        groups = getattr(module, "num_key_value_groups", 1)
        out = shared_prompt_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), scaling, dropout if module.training else 0.0
        )
        return out.transpose(1, 2).contiguous(), None
    if cu_seq_lens_q is None:  # padded (or single unpadded) batch: HF's own sdpa path
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one row [1, N], got batch {query.shape[0]}")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bounds = cu_seq_lens_q.tolist()
    dropout_p = dropout if module.training else 0.0
    segments = [
        F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout_p, is_causal=True, scale=scaling
        )
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a
    ]
    out = torch.cat(segments, dim=2) if segments else query.new_zeros(query.shape)
    return out.transpose(1, 2).contiguous(), None


def _varlen_sdpa_mask(**kwargs: Any) -> Tensor | None:
    # Packed calls pass no 2-D mask: the segments come from cu_seq_lens, and building HF's
    # block-diagonal [N, N] mask would cost N^2 memory for nothing. Padded calls get sdpa's mask.
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**kwargs)


def _register_varlen_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)


def packed_attention_impl(device: torch.device | str | None = None) -> str:
    """The attention implementation that serves packed micro-batches on `device`."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    _register_varlen_sdpa()
    return VARLEN_SDPA


def shares_prompts(share_prompts: bool, device: torch.device) -> bool:
    """trainer.share_prompts where it can hold on `device`: the shared-prompt row needs this
    project's attention (varlen_sdpa); flash-attention's varlen kernels, where a CUDA machine has
    them, take whole sequences only."""
    return share_prompts and packed_attention_impl(device) == VARLEN_SDPA


# --------------------------------------------------------------------------- model inputs per layout
@singledispatch
def model_inputs(mb: Any) -> dict[str, Tensor | int]:
    raise TypeError(f"no forward inputs for {type(mb).__name__}")


@model_inputs.register
def _(mb: PaddedBatch) -> dict[str, Tensor | int]:
    return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}


@model_inputs.register
def _(mb: PackedBatch) -> dict[str, Tensor | int]:
    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.int32)
    longest = mb.max_seqlen
    return {
        "input_ids": mb.input_ids.unsqueeze(0),
        "position_ids": mb.position_ids.unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


@model_inputs.register
def _(layout: SharedPromptLayout) -> dict[str, Any]:
    return {
        "input_ids": layout.input_ids.unsqueeze(0),
        "position_ids": layout.position_ids.unsqueeze(0),
        "shared_prompt_attention": attention_for(layout),
    }


def _forward_layout(model: nn.Module, mb: PaddedBatch | PackedBatch, share_prompts: bool) -> SharedPromptLayout | None:
    """The shared-prompt row of a packed micro-batch when asked for and some prompt repeats."""
    if not (share_prompts and isinstance(mb, PackedBatch)):
        return None
    impl = attention_implementation(model)
    if impl is not None and impl != VARLEN_SDPA:
        # Any other attention would drop the row's attention and mix its branches, silently.
        raise ValueError(
            f"trainer.share_prompts needs the {VARLEN_SDPA!r} attention, the model has {impl!r}: "
            "load it with packed_attention_impl() off flash_attn, or set trainer.share_prompts=false"
        )
    return shared_prompt_layout(mb)


def attention_implementation(model: nn.Module) -> str | None:
    """The HF attention a (DeepSpeed-wrapped, critic-wrapped) model was loaded with; None if unknown."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine
    inner = getattr(inner, "backbone", inner)  # CriticModel
    config = getattr(inner, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


@singledispatch
def _next_token_aligned(mb: Any, per_position: Tensor) -> Tensor:
    raise TypeError(type(mb).__name__)


@_next_token_aligned.register
def _(mb: PaddedBatch, per_position: Tensor) -> Tensor:
    return per_position[:, :-1]  # [b, L] -> [b, L-1]


@_next_token_aligned.register
def _(mb: PackedBatch, per_position: Tensor) -> Tensor:
    # [1, N] -> [N]; a sequence's last position would predict the next sequence's first token:
    # zero it, like the padded layout's padding (conversions carry 0 there).
    flat = per_position[0]
    return flat * _predicts_next(mb).to(flat.dtype)


def _predicts_next(mb: PackedBatch) -> Tensor:
    keep = torch.ones(mb.num_tokens, dtype=torch.bool, device=mb.input_ids.device)
    keep[(mb.cu_seqlens[1:].long() - 1).to(keep.device)] = False
    return keep


# --------------------------------------------------------------------------- public forwards
def sequence_logprobs(
    model: nn.Module, mb: PaddedBatch | PackedBatch, temperature: float, share_prompts: bool = False
) -> Tensor:
    """Logprob of token t+1 given tokens <= t, aligned with `mb.action_mask` ([b, L-1] or [N])."""
    return sequence_logprobs_and_entropy(model, mb, temperature, entropy=False, share_prompts=share_prompts)[0]


def sequence_logprobs_and_entropy(
    model: nn.Module,
    mb: PaddedBatch | PackedBatch,
    temperature: float,
    entropy: bool = True,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`sequence_logprobs` and, when asked, the entropy of each next-token distribution (same layout).

    Only the positions that predict a model token get logits (`logits_to_keep`): the prompt's
    positions would each cost the LM head's V x hidden multiply-adds forward and twice that
    backward, plus a pass of the vocabulary reductions, for outputs every consumer masks away (on
    SmolLM2's ~102-token few-shot prompts and ~10-token answers, ~90 % of the positions). Every
    position that predicts no model token reads 0, as padding does, in both layouts.

    `share_prompts` (trainer.share_prompts): a packed micro-batch's repeated prompts run once
    (rlhf_orch.trainer.shared_prompts); the model's attention must be `varlen_sdpa`.
    """
    from rlhf_orch.algo.losses import entropy_from_logits

    keep, next_tokens = _positions_to_score(mb)
    layout = _forward_layout(model, mb, share_prompts)
    if layout is None:
        logits = model(**model_inputs(mb), use_cache=False, logits_to_keep=keep).logits
    else:
        logits = model(**model_inputs(layout), use_cache=False, logits_to_keep=layout.model_position[keep]).logits
    temperature = _scoring_temperature(mb, keep, temperature)
    logprobs = logprobs_from_logits(logits, next_tokens, temperature=temperature)
    ent = entropy_from_logits(logits, temperature) if entropy else None
    return _in_layout(mb, keep, logprobs), (_in_layout(mb, keep, ent) if entropy else None)


def _scoring_temperature(mb: PaddedBatch | PackedBatch, keep: Tensor, run: float) -> float | Tensor:
    """The temperature each scored position's token was sampled at: `run` (algo.temperature) for
    all, or per position where an agent's call set its own (the `SAMPLING_TEMPERATURE` field; 0 and
    positions that predict no model token read as the run's)."""
    own = mb.fields.get(SAMPLING_TEMPERATURE)
    if own is None:
        return run
    own = own[:, keep] if isinstance(mb, PaddedBatch) else own[keep].unsqueeze(0)
    per_position = torch.where(own > 0, own.float(), torch.full_like(own, run, dtype=torch.float32))
    return run if bool((per_position == run).all()) else per_position


@singledispatch
def _positions_to_score(mb: Any) -> tuple[Tensor, Tensor]:
    raise TypeError(type(mb).__name__)


@_positions_to_score.register
def _(mb: PaddedBatch) -> tuple[Tensor, Tensor]:
    # One set of columns for all rows: from the first column any row predicts a model token at,
    # to the last (right-padded rows; a row's prompt columns after that start read as padding).
    # An empty micro-batch action mask keeps the last column (none when rows are 1 token long).
    columns = mb.action_mask.bool().any(dim=0).nonzero()
    first = int(columns[0]) if columns.numel() else mb.input_ids.shape[1] - 2
    keep = torch.arange(max(first, 0), mb.input_ids.shape[1] - 1, device=mb.input_ids.device)
    return keep, mb.input_ids[:, keep + 1]


@_positions_to_score.register
def _(mb: PackedBatch) -> tuple[Tensor, Tensor]:
    keep = mb.action_mask.bool().nonzero().flatten().to(mb.input_ids.device)
    if not keep.numel():  # no model token (an empty response alone): one position, masked, so the loss keeps its graph
        keep = torch.zeros(1, dtype=torch.long, device=mb.input_ids.device)
    # keep + 1 <= N - 1 (a sequence's last position is never an action; the stand-in above may be the only token).
    return keep, mb.input_ids[(keep + 1).clamp(max=mb.num_tokens - 1)].unsqueeze(0)


@singledispatch
def _in_layout(mb: Any, keep: Tensor, scored: Tensor) -> Tensor:
    raise TypeError(type(mb).__name__)


@_in_layout.register
def _(mb: PaddedBatch, keep: Tensor, scored: Tensor) -> Tensor:
    # [b, K] -> [b, L-1]: the columns before the first scored one are 0 (a cat, not an in-place
    # write, so the backward is a slice), and so is every other position that predicts no model
    # token (a longer prompt's columns): the same values as the packed layout's.
    before = scored.new_zeros(scored.shape[0], mb.input_ids.shape[1] - 1 - scored.shape[1])
    return torch.cat([before, scored], dim=1) * mb.action_mask.to(scored.dtype)


@_in_layout.register
def _(mb: PackedBatch, keep: Tensor, scored: Tensor) -> Tensor:
    # [1, K] -> [N]; masked like the padded layout (the stand-in position of a batch without actions)
    return scored.new_zeros(mb.num_tokens).scatter(0, keep, scored[0]) * mb.action_mask.to(scored.dtype)


def sequence_values(critic: nn.Module, mb: PaddedBatch | PackedBatch, share_prompts: bool = False) -> Tensor:
    """Value of the state after token t, aligned with `mb.action_mask` ([b, L-1] or [N])."""
    layout = _forward_layout(critic, mb, share_prompts)
    if layout is None:
        return _next_token_aligned(mb, critic(**model_inputs(mb)))
    return _next_token_aligned(mb, critic(**model_inputs(layout))[:, layout.model_position])


class CriticModel(nn.Module):
    """The policy's backbone (initialised from the same checkpoint) with a scalar value head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Start from V=0 so the first advantages are the (whitened) rewards themselves.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None, **varlen: Any
    ) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **varlen
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """trainer.gradient_checkpointing: every decoder layer's activations are recomputed in the
    backward instead of kept (HF's own mechanism; non-reentrant, so packed kwargs pass through)."""
    hf_model = model.backbone if isinstance(model, CriticModel) else model
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.config.use_cache = False


def load_policy(path: str, dtype: str, device: torch.device | str | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=packed_attention_impl(device)
    )


def load_critic(path: str, dtype: str, device: torch.device | str | None = None) -> CriticModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=packed_attention_impl(device)
    )
    critic = CriticModel(backbone, backbone.config.hidden_size)
    return critic.to(getattr(torch, dtype))


def load_reward_model(path: str, dtype: str, device: torch.device | str | None = None) -> nn.Module:
    """A `*ForSequenceClassification` checkpoint, with the attention that serves packed micro-batches."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=packed_attention_impl(device)
    )


def _last_token_positions(mb: PaddedBatch | PackedBatch) -> Tensor:
    """Index of each sequence's last token: [b] rows' column (padded) or [b] flat positions (packed)."""
    if isinstance(mb, PaddedBatch):
        return mb.seq_lens.to(mb.input_ids.device).long() - 1
    return mb.cu_seqlens[1:].to(mb.input_ids.device).long() - 1


def sequence_scores(reward_model: nn.Module, mb: PaddedBatch | PackedBatch) -> Tensor:
    """[b] scalar scores: the classification head at each sequence's last token (as HF computes it).

    The backbone runs on the micro-batch's own layout (packed: varlen, no padding), and only the
    last positions go through the head -- what `*ForSequenceClassification.forward` does after
    locating the last non-pad token, without needing a pad token to find it.
    """
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    inputs = model_inputs(mb)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [b, L, h] or [1, N, h]
    last = _last_token_positions(mb)
    if isinstance(mb, PaddedBatch):
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        picked = hidden[0, last]
    return reward_model.score(picked).squeeze(-1).float()
