"""The `algo` group's declarations: the schedule, the policy loss, the KL term. Each option's runtime
class (`rlhf_orch.algo.estimators`) extends its declaration here with the math.

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING


# The values algo.loss_agg and algo.kl_estimator take (rlhf_orch.algo.losses implements each).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_DIVERGENCE_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


@dataclass
class AlgoConfig:
    """The RL algorithm: the schedule every option shares, the policy loss, the KL term.

    Each option's `_target_` is a class in `rlhf_orch.algo.estimators` that extends its schema
    below (so the built object carries these fields and adds the math). The ClassVars say what the
    algorithm needs (`validate`, the planner and the loop ask, never check names).
    """

    _target_: str = MISSING
    num_steps: int = 100
    rollout_batch_size: int = 32  # prompts per step
    samples_per_prompt: int = 4
    train_batch_size: int = 64  # sequences per optimizer step (global)
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    ppo_epochs: int = 1  # passes over the rollout; micro-batches reshuffled between passes
    actor_lr: float = 1e-4
    temperature: float = 1.0  # sampling temperature of the rollout (and of the trainer's logprobs)
    # Tokens every rollout response has at least: EOS cannot end it before (vLLM's min_tokens); 0 = off.
    # Makes every response long, e.g. for benchmarks of generation-heavy settings (scripts/bench_peers.py).
    min_response_len: int = 0
    grad_clip: float = 1.0
    # Policy loss: PPO's clipped surrogate with a decoupled range [1 - clip_low, 1 + clip_high].
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip PPO: a token with A < 0 loses at most -A * clip_ratio_c (> 1; veRL/OpenRLHF use 3). null = off.
    clip_ratio_c: Optional[float] = None
    # "token-mean", "seq-mean-token-sum", "seq-mean-token-mean" or "seq-mean-token-sum-norm".
    loss_agg: str = "token-mean"
    loss_agg_norm_len: int = 0  # seq-mean-token-sum-norm's constant; 0 = data.response_max_len
    entropy_coef: float = 0.0
    # KL to the reference: "in_reward" (a per-token penalty in the reward; k1 or k2) or "in_loss"
    # (a loss term; k1, k2 or low_var_kl/k3) or "off". k3 in the reward is refused: its gradient
    # there is biased (it is an estimator of the KL's value, not of its gradient).
    kl_placement: str = "in_reward"
    kl_coef: float = 0.01
    kl_estimator: str = "k1"
    # Truncated importance sampling: each token's policy loss is weighted by
    # min(pi_old / pi_engine, tis_cap), pi_engine being the log-probs the engine sampled with
    # (stale weights under pipeline=one_step_off, other kernels always). null = off.
    tis_cap: Optional[float] = None
    # AReaL's decoupled PPO (Fu et al. 2025): the clip stays against pi_old (the proximal policy)
    # and each token's loss is weighted by pi_old / pi_engine; a token whose weight exceeds
    # decoupled_is_cap is dropped from the loss (weight 0), where tis_cap would truncate it.
    # > 1 (AReaL's behav_imp_weight_cap, 5 in its examples); not with tis_cap. null = off.
    decoupled_is_cap: Optional[float] = None
    # The teacher's term (teacher=<model option>): every action token's advantage gains
    # distill_coef * (log pi_teacher - log pi_old) of its sampled token, i.e. the negative of the
    # per-token reverse KL to the teacher (on-policy distillation; no discount), added after the
    # algorithm's own advantages (their baselines and normalisation untouched). 0 = off (no
    # teacher is placed).
    distill_coef: float = 0.0

    needs_critic: ClassVar[bool] = False
    group_estimator: ClassVar[bool] = False  # advantages compare the samples of one prompt
    # Advantages read rewards per token (GAE, a return-to-go), so env.reward=per_turn changes them;
    # outcome estimators judge a trajectory by one score (per-turn rewards would be their sum).
    per_token_rewards: ClassVar[bool] = False

    # Derived (not keys): what the KL settings ask of the run.
    @property
    def kl_in_reward(self) -> bool:
        return self.kl_placement == "in_reward" and self.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_placement == "in_loss" and self.kl_coef > 0

    @property
    def needs_reference(self) -> bool:
        """A reference model is placed and run only when a KL term uses it."""
        return self.kl_in_reward or self.kl_in_loss

    @property
    def uses_teacher(self) -> bool:
        """A teacher scores every sampled token (`distill_coef`): teacher= must name a model."""
        return self.distill_coef > 0

    @property
    def frozen_models(self) -> tuple[str, ...]:
        """The frozen models the reference ranks hold, by the name their log-probs go under: "ref"
        the KL reference (the initial policy), "teacher" the teacher -- whichever the algorithm reads."""
        return ("ref",) * self.needs_reference + ("teacher",) * self.uses_teacher

    @property
    def needs_reference_ranks(self) -> bool:
        """The planner places reference ranks: some frozen model is read (`frozen_models`)."""
        return bool(self.frozen_models)

    @property
    def compares_group_samples(self) -> bool:
        """Each sample is judged against the other samples of its prompt (a group of one has none)."""
        return self.group_estimator


@dataclass
class PPOConfig(AlgoConfig):
    """PPO with a learned critic: GAE over KL-shaped token rewards."""

    _target_: str = "rlhf_orch.algo.estimators.PPO"
    critic_lr: float = 5e-4
    gamma: float = 1.0
    lam: float = 0.95
    value_clip_eps: float = 0.2
    whiten_advantages: bool = True  # over the global batch (all data-parallel ranks)

    needs_critic: ClassVar[bool] = True
    per_token_rewards: ClassVar[bool] = True


@dataclass
class GRPOConfig(AlgoConfig):
    """GRPO: outcome advantages relative to the prompt's group; norm_by_std=false is Dr. GRPO."""

    _target_: str = "rlhf_orch.algo.estimators.GRPO"
    norm_by_std: bool = True
    eps: float = 1e-6
    kl_placement: str = "in_loss"
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"

    group_estimator: ClassVar[bool] = True


@dataclass
class RLOOConfig(AlgoConfig):
    """RLOO: each sample's baseline is the mean reward of the other samples of its prompt."""

    _target_: str = "rlhf_orch.algo.estimators.RLOO"
    kl_placement: str = "in_loss"
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"

    group_estimator: ClassVar[bool] = True


@dataclass
class ReinforcePPConfig(AlgoConfig):
    """REINFORCE++: discounted return-to-go of KL-shaped rewards, normalised over the global batch."""

    _target_: str = "rlhf_orch.algo.estimators.ReinforcePP"
    gamma: float = 1.0
    group_baseline: bool = False  # reinforce_pp_baseline: subtract the prompt group's mean score first

    per_token_rewards: ClassVar[bool] = True

    @property
    def compares_group_samples(self) -> bool:
        return self.group_baseline


@dataclass
class DAPOConfig(GRPOConfig):
    """DAPO: GRPO with clip-higher, token-mean loss, no KL, dynamic sampling and overlong shaping."""

    _target_: str = "rlhf_orch.algo.estimators.DAPO"
    clip_high: float = 0.28
    kl_placement: str = "off"
    kl_coef: float = 0.0
    dynamic_sampling: bool = True
    max_gen_batches: int = 4  # rollout rounds per step at most to fill the batch with informative groups
    overlong_buffer: int = 0  # tokens before data.response_max_len where the penalty ramps in (0: off)
    overlong_penalty: float = 1.0


@dataclass
class OnPolicyDistillConfig(AlgoConfig):
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): the policy samples, the
    teacher scores every sampled token, and the advantage of token t is
    -(log pi_old(y_t) - log pi_teacher(y_t)), the negative per-token reverse KL, with no discount and
    no critic; the reward is not trained on (it is still scored and logged). The same term rides
    on any other algorithm through its `distill_coef`."""

    _target_: str = "rlhf_orch.algo.estimators.OnPolicyDistill"
    distill_coef: float = 1.0
    kl_placement: str = "off"
    kl_coef: float = 0.0
