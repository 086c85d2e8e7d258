"""From the `reward` config to what runs: a rule scorer for the engines and, optionally, a reward-model role.

`build_reward(cfg.reward)` returns a `RewardSetup`:

* `rule` -- a `RuleScoring` (picklable) that the engines call on their own samples (the padded
  baseline calls it on the driver): the rule function, its weight, and how it runs (inline with a
  per-sample timeout, or in a bounded pool of Ray tasks -- `rlhf_orch.reward.execution`).
* `model` -- a `RewardModel` when the option is `reward=model`: the planner gives it ranks, it
  scores the same experience the trainers receive, actor to actor.

How a sample's terms and weights make its reward: `rlhf_orch.reward.combine.sample_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.reward.base import Response, RewardFunction
from rlhf_orch.reward.combine import sample_reward
from rlhf_orch.reward.execution import ScoredBatch, score_batch
from rlhf_orch.reward.options import RuleRewardConfig


@dataclass(frozen=True)
class RuleScoring:
    """What an engine runs on a finished batch: `fn` under the run's execution settings, times `weight`
    (reward.timeout_s, reward.pool_size, and the rule's weight: their defaults are the config's)."""

    fn: RewardFunction
    weight: float
    timeout_s: float
    pool_size: int

    @property
    def name(self) -> str:
        return self.fn.name

    def __call__(
        self, prompts: Sequence[Any], responses: Sequence[Response], on_scored: Callable[[], None] = lambda: None
    ) -> ScoredBatch:
        """`on_scored`: called as the batch moves (the engine's liveness count, `score_batch`)."""
        scored = score_batch(self.fn, prompts, responses, self.timeout_s, self.pool_size, on_scored=on_scored)
        if self.weight != 1.0:
            scored.scores = [sample_reward(s, self.weight) for s in scored.scores]
        return scored


@dataclass(frozen=True)
class RewardSetup:
    rule: RuleScoring | None
    model: Any | None  # rlhf_orch.reward.model.RewardModel

    @property
    def needs_label(self) -> bool:
        return bool(self.rule and self.rule.fn.needs_label)

    @property
    def has_model(self) -> bool:
        return self.model is not None

    def describe(self) -> str:
        terms = []
        if self.rule:
            terms.append(f"{self.rule.weight:g} x {self.rule.name}")
        if self.model:
            terms.append(f"{self.model.weight:g} x reward model")
        return " + ".join(terms)


def build_reward(node: DictConfig | dict) -> RewardSetup:
    """Instantiate the `reward` option; the execution keys are settings of the run, not the function's."""
    conf = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    # A rule option declares them; a rule node given by hand (a reward model's `rule`) may leave
    # them out: the declaration's values, as a rule option would have them.
    execution = {k: conf.pop(k, getattr(RuleRewardConfig, k)) for k in RuleRewardConfig.execution_keys}
    _check_execution(**execution)
    rule_node = conf.pop("rule", None)  # only a reward model option carries a nested rule
    target = instantiate(conf)
    if isinstance(target, RewardFunction):
        return RewardSetup(rule=RuleScoring(target, 1.0, **execution), model=None)
    rule = build_reward(rule_node).rule if rule_node else None
    if rule is not None:
        rule = RuleScoring(rule.fn, target.rule_weight, rule.timeout_s, rule.pool_size)
    return RewardSetup(rule=rule, model=target)


def _check_execution(timeout_s: float, pool_size: int) -> None:
    if not timeout_s > 0:
        raise ValueError(f"reward.timeout_s={timeout_s}: must be > 0 (seconds one sample may take to score)")
    if pool_size < 0:
        raise ValueError(f"reward.pool_size={pool_size}: must be >= 0 (0 scores inline on the engines)")
