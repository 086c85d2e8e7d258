"""The `algo` options: each class extends its declaration (`rlhf_orch.algo.options`) with its math.

An algorithm answers two questions, each in the place where it is cheapest:

* `sample_values(scores, group_ids, response_lens, max_response_len)` -- on the driver, which already holds one
  score per sample: the per-sample number the ranks need. Outcome estimators (GRPO, Dr. GRPO,
  RLOO, DAPO) return the advantage itself; REINFORCE++-baseline returns the group-centred score;
  PPO and REINFORCE++ return the score unchanged. Groups are always whole here (the driver sees
  every sample), and only these floats go to the ranks -- never sequences. (Per-turn rewards,
  `env.reward=per_turn`, travel with the sequences; the rest of the score beyond them goes on the
  last token: `ppo_math.token_rewards`.)
* `token_targets(rows, all_reduce)` -- on each policy rank, per micro-batch rows `[b, T]`: token
  advantages (and the critic's returns for PPO). Batch-wide normalisation (PPO's whitening,
  REINFORCE++'s) uses moments summed over all data-parallel ranks through `all_reduce`, so it is
  the global batch's, not each rank's.

The ClassVars of the schema (`needs_critic`, `group_estimator`) tell the planner and the loop
which roles exist; the loop never checks an algorithm's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from rlhf_orch.algo.advantages import (
    distill_advantages,
    dynamic_sampling_keep,
    gae_advantages,
    grpo_advantages,
    masked_moments,
    outcome_to_tokens,
    overlong_reward_penalty,
    reinforce_pp_returns,
    rloo_advantages,
    whiten_with_moments,
)
from rlhf_orch.algo.losses import kl_divergence
from rlhf_orch.algo.ppo_math import token_rewards
from rlhf_orch.algo.options import (
    DAPOConfig,
    GRPOConfig,
    OnPolicyDistillConfig,
    PPOConfig,
    ReinforcePPConfig,
    RLOOConfig,
)

AllReduce = Callable[[Tensor], Tensor]  # sum over the policy's data-parallel ranks


@dataclass
class TargetRows:
    """One micro-batch as `[b, T]` rows over action positions (see `rlhf_orch.algo.ppo_math`)."""

    mask: Tensor
    sample_values: Tensor  # [b]: what `sample_values` computed for each row's sample
    # pi_old; None when the update's own forward gives them (trainer.old_logprobs): only a KL in
    # the reward and the teacher's term read them here, and then they are always computed first.
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]  # None when the algorithm uses no reference
    values: Optional[Tensor]  # critic values; None without a critic
    turn_rewards: Optional[Tensor] = None  # env.reward=per_turn: each turn's reward on its last token
    teacher_logprobs: Optional[Tensor] = None  # the teacher's, when the algorithm has a teacher term


@dataclass
class Targets:
    advantages: Tensor
    returns: Optional[Tensor]  # critic targets (PPO only)


class Algorithm:
    """Shared behaviour; concrete classes mix it into their schema dataclass."""

    # ------------------------------------------------------------ what the algorithm needs
    # (kl_in_reward, kl_in_loss and needs_reference are derived on the schema, AlgoConfig)
    @property
    def uses_dynamic_sampling(self) -> bool:
        return bool(getattr(self, "dynamic_sampling", False))

    def norm_len(self, response_max_len: int) -> int:
        return self.loss_agg_norm_len or response_max_len

    # ------------------------------------------------------------ driver side
    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        return scores, {}

    def keep_groups(self, scores: Tensor, group_ids: Tensor) -> Tensor:
        """Dynamic sampling's filter (per sample: keep it); only asked when `uses_dynamic_sampling`."""
        return torch.ones_like(group_ids, dtype=torch.bool)

    # ------------------------------------------------------------ rank side
    def targets(self, rows: list[TargetRows], all_reduce: AllReduce) -> list[Targets]:
        """The token targets the update trains on: the algorithm's own, plus the teacher's term."""
        out = self.token_targets(rows, all_reduce)
        if self.uses_teacher:
            for r, t in zip(rows, out):
                if r.old_logprobs is None or r.teacher_logprobs is None:
                    raise ValueError("the teacher term reads the old and the teacher's log-probs, and one is missing")
                t.advantages = t.advantages + distill_advantages(
                    r.old_logprobs, r.teacher_logprobs, r.mask, self.distill_coef
                )
        return out

    def token_targets(self, rows: list[TargetRows], all_reduce: AllReduce) -> list[Targets]:
        raise NotImplementedError

    def _reward_kl(self, r: TargetRows) -> Tensor:
        """The KL penalty that goes into the token rewards (0 unless kl_placement=in_reward)."""
        if not self.kl_in_reward:
            return torch.zeros_like(r.mask, dtype=torch.float32)
        if r.old_logprobs is None:
            raise ValueError("the KL penalty in the reward reads the old log-probs, and none were computed")
        return kl_divergence(r.old_logprobs, r.ref_logprobs, self.kl_estimator, mask=r.mask)


def _whiten_globally(
    tensors: list[Tensor], masks: list[Tensor], all_reduce: AllReduce, shift_mean: bool = True
) -> list[Tensor]:
    """Normalise over every masked token of every micro-batch of every data-parallel rank."""
    moments = torch.zeros(3, dtype=torch.float64)
    for x, m in zip(tensors, masks):
        moments += torch.stack(masked_moments(x, m)).to(torch.float64).cpu()
    total_sum, total_sq, count = all_reduce(moments).unbind()
    return [
        whiten_with_moments(x, m, total_sum, total_sq, count, shift_mean=shift_mean) for x, m in zip(tensors, masks)
    ]


@dataclass
class PPO(PPOConfig, Algorithm):
    """GAE over KL-shaped token rewards with the critic's values; whitened over the global batch.
    Per-turn rewards (`TargetRows.turn_rewards`) stay on their turns' last tokens."""

    def token_targets(self, rows: list[TargetRows], all_reduce: AllReduce) -> list[Targets]:
        out = []
        for r in rows:
            coef = self.kl_coef if self.kl_in_reward else 0.0
            rewards = token_rewards(r.sample_values, self._reward_kl(r), r.mask, coef, r.turn_rewards)
            adv, ret = gae_advantages(rewards, r.values, r.mask, self.gamma, self.lam)
            out.append(Targets(adv, ret))
        if self.whiten_advantages and out:
            for t, adv in zip(out, _whiten_globally([t.advantages for t in out], [r.mask for r in rows], all_reduce)):
                t.advantages = adv
        return out


@dataclass
class ReinforcePP(ReinforcePPConfig, Algorithm):
    """REINFORCE++ (Hu 2025): return-to-go of (score - KL) per token, normalised over the global batch.
    Per-turn rewards stay on their turns' last tokens: a turn's tokens get the rewards from it on."""

    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        if not self.group_baseline:
            return scores, {}
        # The group-centred score r - mean(group) is GRPO's advantage without std normalisation.
        return grpo_advantages(scores, group_ids, norm_by_std=False), {}

    def token_targets(self, rows: list[TargetRows], all_reduce: AllReduce) -> list[Targets]:
        coef = self.kl_coef if self.kl_in_reward else 0.0
        returns = [
            reinforce_pp_returns(r.sample_values, r.mask, self._reward_kl(r), coef, self.gamma, placed=r.turn_rewards)
            for r in rows
        ]
        advantages = _whiten_globally(returns, [r.mask for r in rows], all_reduce)
        return [Targets(a, None) for a in advantages]


class _OutcomeAlgorithm(Algorithm):
    """One advantage per sample, computed on the driver; every action token of the sample gets it."""

    def token_targets(self, rows: list[TargetRows], all_reduce: AllReduce) -> list[Targets]:
        return [Targets(outcome_to_tokens(r.sample_values, r.mask), None) for r in rows]


@dataclass
class GRPO(GRPOConfig, _OutcomeAlgorithm):
    """GRPO (Shao et al. 2024): (r - group mean) / (group std + eps); Dr. GRPO with norm_by_std=False."""

    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        return grpo_advantages(scores, group_ids, norm_by_std=self.norm_by_std, eps=self.eps), {}


@dataclass
class RLOO(RLOOConfig, _OutcomeAlgorithm):
    """RLOO (Ahmadian et al. 2024): r minus the mean of the other samples of the same prompt."""

    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        return rloo_advantages(scores, group_ids), {}


@dataclass
class DAPO(DAPOConfig, _OutcomeAlgorithm):
    """DAPO (Yu et al. 2025): GRPO on overlong-shaped scores; groups of equal scores are dropped and
    replaced by fresh ones (dynamic sampling, in the packed transfer); clip-higher and token-mean
    loss come from the schema's defaults."""

    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        stats = {}
        if self.overlong_buffer > 0:
            penalty = overlong_reward_penalty(
                response_lens, max_response_len, self.overlong_buffer, self.overlong_penalty
            )
            scores = scores + penalty
            stats["reward/overlong_penalty"] = float(penalty.mean())
        return grpo_advantages(scores, group_ids, norm_by_std=self.norm_by_std, eps=self.eps), stats

    def keep_groups(self, scores: Tensor, group_ids: Tensor) -> Optional[Tensor]:
        return dynamic_sampling_keep(scores, group_ids)


@dataclass
class OnPolicyDistill(OnPolicyDistillConfig, _OutcomeAlgorithm):
    """The teacher's term alone (`Algorithm.targets` adds it): no outcome advantage."""

    def sample_values(
        self, scores: Tensor, group_ids: Tensor, response_lens: Tensor, max_response_len: int
    ) -> tuple[Tensor, dict[str, float]]:
        return torch.zeros_like(scores), {}
