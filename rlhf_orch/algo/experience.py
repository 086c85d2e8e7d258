"""From scored rollouts to PPO training targets: KL-shaped token rewards, GAE, whitening.

Pure: every input is a list of micro-batches ([b, L-1] tensors aligned with `action_mask`), so
the same function serves every transfer layout and runs inside whichever worker holds the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_orch.algo.ppo_math import gae_advantages, kl_penalty, masked_whiten, token_rewards


@dataclass(frozen=True)
class AdvantageSettings:
    gamma: float
    lam: float
    kl_coef: float
    kl_estimator: str
    whiten_advantages: bool


@dataclass
class MicroBatchTargets:
    advantages: Tensor
    returns: Tensor
    kl: Tensor


def compute_targets(
    action_masks: list[Tensor],
    scores: list[Tensor],
    old_logprobs: list[Tensor],
    ref_logprobs: list[Tensor],
    values: list[Tensor],
    settings: AdvantageSettings,
) -> tuple[list[MicroBatchTargets], dict[str, float]]:
    """GAE per micro-batch; advantages whitened over all of this rank's tokens together."""
    targets: list[MicroBatchTargets] = []
    for mask, score, old_lp, ref_lp, value in zip(action_masks, scores, old_logprobs, ref_logprobs, values):
        kl = kl_penalty(old_lp, ref_lp, settings.kl_estimator)
        rewards = token_rewards(score, kl, mask, settings.kl_coef)
        adv, ret = gae_advantages(rewards, value, mask, settings.gamma, settings.lam)
        targets.append(MicroBatchTargets(adv, ret, kl))

    if settings.whiten_advantages and targets:
        # Whiten over the rank's whole batch, not per micro-batch: micro-batches can be tiny.
        flat_adv = torch.cat([t.advantages[m.bool()] for t, m in zip(targets, action_masks)])
        flat_mask = torch.ones_like(flat_adv)
        whitened = masked_whiten(flat_adv, flat_mask)
        offset = 0
        for t, m in zip(targets, action_masks):
            n = int(m.bool().sum())
            adv = torch.zeros_like(t.advantages)
            adv[m.bool()] = whitened[offset : offset + n]
            t.advantages = adv
            offset += n

    tokens = sum(float(m.sum()) for m in action_masks)
    kl_sum = sum(float((t.kl * m).sum()) for t, m in zip(targets, action_masks))
    ret_sum = sum(float((t.returns * m).sum()) for t, m in zip(targets, action_masks))
    stats = {
        "kl": kl_sum / max(tokens, 1.0),
        "returns_mean": ret_sum / max(tokens, 1.0),
        "response_tokens": tokens,
        "values_mean": float(
            sum(float((v * m).sum()) for v, m in zip(values, action_masks)) / max(tokens, 1.0)
        ),
    }
    return targets, stats


__all__ = ["AdvantageSettings", "MicroBatchTargets", "compute_targets"]
