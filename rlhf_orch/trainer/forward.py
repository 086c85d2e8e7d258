"""Forward passes on one micro-batch: next-token logprobs (policy, reference) and values (critic)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlhf_orch.algo.ppo_math import logprobs_from_logits
from rlhf_orch.transfer.batch import PaddedBatch


def sequence_logprobs(model: nn.Module, mb: PaddedBatch, temperature: float) -> Tensor:
    """[b, L-1]: logprob of token t+1 given tokens <= t (aligned with `mb.action_mask`)."""
    logits = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
    ).logits
    return logprobs_from_logits(logits[:, :-1], mb.input_ids[:, 1:], temperature=temperature)


def sequence_values(critic: nn.Module, mb: PaddedBatch) -> Tensor:
    """[b, L-1]: value of the state after token t (aligned with `mb.action_mask`)."""
    values = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    return values[:, :-1]


class CriticModel(nn.Module):
    """The policy's backbone (initialised from the same checkpoint) with a scalar value head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Start from V=0 so the first advantages are the (whitened) rewards themselves.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def load_policy(path: str, dtype: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))


def load_critic(path: str, dtype: str) -> CriticModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
    critic = CriticModel(backbone, backbone.config.hidden_size)
    return critic.to(getattr(torch, dtype))
