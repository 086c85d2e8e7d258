"""RLHF algorithms as pure tensor math.

One home per formula. `ppo_math`: masked reductions, token rewards, log-probs. `advantages`: GAE,
GRPO / Dr. GRPO, RLOO, REINFORCE++(-baseline), DAPO's overlong penalty and dynamic-sampling
filter. `losses`: loss aggregation (veRL's modes, data-parallel denominators, packed sequences),
the policy loss (decoupled and dual clip, TIS, AReaL's decoupled PPO weights), the value loss, KL
estimators k1/k2/k3, entropy. `estimators`: the `algo` options built from them. `oracle`: one
whole training update written plainly, the specification the distributed trainer is tested against.

The names load on first use (PEP 562): the package's `options` (the config's declarations) must not
pull in torch.
"""

from importlib import import_module

_NAMES = {
    "dynamic_sampling_keep": "rlhf_orch.algo.advantages",
    "gae_advantages": "rlhf_orch.algo.advantages",
    "grpo_advantages": "rlhf_orch.algo.advantages",
    "masked_moments": "rlhf_orch.algo.advantages",
    "outcome_to_tokens": "rlhf_orch.algo.advantages",
    "overlong_reward_penalty": "rlhf_orch.algo.advantages",
    "reinforce_pp_advantages": "rlhf_orch.algo.advantages",
    "reinforce_pp_returns": "rlhf_orch.algo.advantages",
    "rloo_advantages": "rlhf_orch.algo.advantages",
    "whiten_with_moments": "rlhf_orch.algo.advantages",
    "KL_DIVERGENCE_ESTIMATORS": "rlhf_orch.algo.losses",
    "LOSS_AGGREGATIONS": "rlhf_orch.algo.losses",
    "aggregate_loss": "rlhf_orch.algo.losses",
    "aggregation_weights": "rlhf_orch.algo.losses",
    "clipped_policy_loss": "rlhf_orch.algo.losses",
    "clipped_value_loss": "rlhf_orch.algo.losses",
    "decoupled_is_weights": "rlhf_orch.algo.losses",
    "entropy_from_logits": "rlhf_orch.algo.losses",
    "kl_divergence": "rlhf_orch.algo.losses",
    "loss_denominator": "rlhf_orch.algo.losses",
    "truncated_is_weights": "rlhf_orch.algo.losses",
    "last_token_onehot": "rlhf_orch.algo.ppo_math",
    "logprobs_from_logits": "rlhf_orch.algo.ppo_math",
    "masked_mean": "rlhf_orch.algo.ppo_math",
    "masked_var": "rlhf_orch.algo.ppo_math",
    "masked_whiten": "rlhf_orch.algo.ppo_math",
    "token_rewards": "rlhf_orch.algo.ppo_math",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
