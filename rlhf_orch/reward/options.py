"""The `reward` group's declarations: rules, a user's function, a reward model (`rlhf_orch.reward`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from omegaconf import MISSING


@dataclass
class RewardConfig:
    """How responses are scored (`rlhf_orch.reward`): a function (rule) or a reward model."""

    _target_: str = MISSING

    scores_after_handover: ClassVar[bool] = False


@dataclass
class RuleRewardConfig(RewardConfig):
    """A scoring function, run where the samples are (engines).

    `timeout_s` and `pool_size` say how the rule runs (not the rule's own arguments): a sample
    taking longer than `timeout_s` scores 0 and is counted; `pool_size > 0` scores in that many
    Ray tasks instead of inline on the engine.
    """

    timeout_s: float = 10.0
    pool_size: int = 0

    execution_keys: ClassVar[tuple[str, ...]] = ("timeout_s", "pool_size")


@dataclass
class DigitRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.DigitReverseRule"


@dataclass
class GSM8KRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.GSM8KRule"
    method: str = "strict"  # "strict" (#### extraction, as veRL scores) or "flexible" (last number)
    format_score: float = 0.0
    score: float = 1.0


@dataclass
class MathVerifyRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.MathVerifyRule"


@dataclass
class CountdownRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.rules.CountdownRule"
    format_score: float = 0.1
    score: float = 1.0


@dataclass
class ReasoningGymRuleConfig(RuleRewardConfig):
    _target_: str = "rlhf_orch.reward.reasoning_gym_rule.ReasoningGymRule"
    # false: only a full score counts (1.0), every partial one is 0 -- e.g. basic_arithmetic's credit for
    # the right number inside a longer answer ("19.10" for 19 scores 0.4), which a policy can learn to farm.
    partial_credit: bool = True


@dataclass
class CustomRewardConfig(RuleRewardConfig):
    """A user's function: veRL's `compute_score(data_source, solution_str, ground_truth, extra_info)`."""

    _target_: str = "rlhf_orch.reward.custom.CustomReward"
    path: str = MISSING
    name: str = "compute_score"
    # One call with lists for the whole batch, inline on the engine (so reward.pool_size must be 0);
    # reward.timeout_s x the batch's size limits that call, and a timeout or an exception scores it all 0.
    batched: bool = False


@dataclass
class ModelRewardConfig(RewardConfig):
    """A sequence-classification reward model in its own Ray actor(s), placed by the planner.

    `model_path: null` builds the tiny reward model locally (CPU tests). A rule can be added with
    `+reward@reward.rule=<rule option>`; the score is `weight * model + rule_weight * rule`. It has
    no timeout_s / pool_size of its own: its forward passes are waits of the step
    (fault.step_timeout_s); an added rule has its own (`reward.rule.timeout_s`, `reward.rule.pool_size`).
    """

    _target_: str = "rlhf_orch.reward.model.RewardModel"
    model_path: Optional[str] = None
    weight: float = 1.0
    rule: Optional[Any] = None
    rule_weight: float = 1.0
    micro_batch_size: int = 16

    scores_after_handover: ClassVar[bool] = True  # known only once its ranks hold the sequences
