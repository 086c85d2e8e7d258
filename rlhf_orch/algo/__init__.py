"""PPO for language models: pure tensor math (`ppo_math`)."""

from rlhf_orch.algo.ppo_math import (
    KL_ESTIMATORS,
    gae_advantages,
    kl_penalty,
    last_token_onehot,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "gae_advantages",
    "kl_penalty",
    "last_token_onehot",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "token_rewards",
    "value_loss",
]
