"""A sample's reward from its terms: the one place the terms and their weights are combined.

    no environment:     rule_weight x rule
    an environment:     env + env_weight x (rule_weight x rule)    (env.reward_weight; no reward: 0)
    a reward model:     ... + model_weight x model                (reward.weight; no rule: 0 + ...)

The stages run where their inputs are: the rule (and an environment's reward) on the engines, the
reward model's score on the driver once its ranks scored; each stage calls `sample_reward` with the
terms it has, the score so far entering as an already weighted rule (`rule_weight` 1). The
algorithm's shaping of the final score (DAPO's overlong penalty) belongs to the algorithm
(`rlhf_orch.algo`), applied to what this returns. Pure: tests/reward/test_combine.py.
"""

from __future__ import annotations


def sample_reward(
    rule: float | None,
    rule_weight: float,
    *,
    env: float | None = None,
    env_weight: float | None = None,
    model: float | None = None,
    model_weight: float | None = None,
) -> float:
    """One sample's reward. `rule`: the rule's score (None: no rule, or not scored); `env_weight`:
    the sample is an environment's trajectory with reward `env` (None: no environment); the rule
    counts there only when `env_weight` is not 0; `model_weight`: a reward model scored it `model`
    (None: no reward model). The arithmetic is kept as the stages did it (a weight of 1 leaves
    the rule's score as it is), so runs score bit for bit as before."""
    weighted = None if rule is None else (rule if rule_weight == 1.0 else rule_weight * rule)
    if env_weight is not None:
        score = float(env) if env is not None else 0.0
        if env_weight and weighted is not None:
            score = score + env_weight * float(weighted)
    else:
        score = weighted
    if model_weight is None:
        return 0.0 if score is None else score
    return (0.0 if score is None else score) + model_weight * model
