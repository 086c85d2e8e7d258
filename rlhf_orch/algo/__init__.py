"""RLHF algorithms as pure tensor math.

One home per formula. `ppo_math`: masked reductions, token rewards, log-probs. `advantages`: GAE,
GRPO / Dr. GRPO, RLOO, REINFORCE++(-baseline), DAPO's overlong penalty and dynamic-sampling
filter. `losses`: loss aggregation (veRL's modes, data-parallel denominators, packed sequences),
the policy loss (decoupled and dual clip, TIS, AReaL's decoupled PPO weights), the value loss, KL
estimators k1/k2/k3, entropy. `estimators`: the `algo` options built from them. `oracle`: one
whole training update written plainly, the specification the distributed trainer is tested against.
"""

from rlhf_orch.algo.advantages import (
    dynamic_sampling_keep,
    gae_advantages,
    grpo_advantages,
    masked_moments,
    outcome_to_tokens,
    overlong_reward_penalty,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten_with_moments,
)
from rlhf_orch.algo.losses import (
    KL_DIVERGENCE_ESTIMATORS,
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
from rlhf_orch.algo.ppo_math import (
    last_token_onehot,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    token_rewards,
)

__all__ = [
    "KL_DIVERGENCE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "aggregation_weights",
    "clipped_policy_loss",
    "clipped_value_loss",
    "decoupled_is_weights",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_divergence",
    "last_token_onehot",
    "logprobs_from_logits",
    "loss_denominator",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "masked_whiten",
    "outcome_to_tokens",
    "overlong_reward_penalty",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "token_rewards",
    "truncated_is_weights",
    "whiten_with_moments",
]
