"""`sample_reward`: every way a sample's reward terms are combined (rule, environment, reward model)."""

from __future__ import annotations

from rlhf_orch.reward.combine import sample_reward


def test_a_rule_alone_is_its_weighted_score_and_a_weight_of_one_leaves_it_as_it_is():
    assert sample_reward(1, 1.0) == 1 and type(sample_reward(1, 1.0)) is int
    assert sample_reward(0.5, 0.3) == 0.3 * 0.5
    assert sample_reward(None, 1.0) == 0.0


def test_an_environment_s_reward_takes_the_rule_times_its_weight_only_when_that_weight_is_not_zero():
    assert sample_reward(1.0, 1.0, env=0.25, env_weight=0.5) == 0.25 + 0.5 * 1.0
    assert sample_reward(1.0, 1.0, env=0.25, env_weight=0.0) == 0.25
    assert sample_reward(None, 1.0, env=0.25, env_weight=0.5) == 0.25
    assert sample_reward(1.0, 1.0, env=None, env_weight=0.5) == 0.5  # a trajectory with no reward counts 0
    assert sample_reward(None, 1.0, env=None, env_weight=0.0) == 0.0
    assert sample_reward(2.0, 0.5, env=1.0, env_weight=0.5) == 1.0 + 0.5 * (0.5 * 2.0)


def test_a_reward_model_s_score_is_added_times_its_weight_to_the_rule_or_to_zero():
    assert sample_reward(0.7, 1.0, model=2.0, model_weight=0.1) == 0.7 + 0.1 * 2.0
    assert sample_reward(None, 1.0, model=2.0, model_weight=0.1) == 0.0 + 0.1 * 2.0
    assert sample_reward(1.0, 0.5, model=-1.0, model_weight=1.0) == 0.5 * 1.0 + 1.0 * -1.0


def test_the_stages_compose_as_one_formula():
    # The engines combine the rule and the environment; the driver adds the reward model to that.
    on_engine = sample_reward(sample_reward(3.0, 0.5), 1.0, env=0.2, env_weight=0.4)
    assert sample_reward(on_engine, 1.0, model=1.5, model_weight=2.0) == (0.2 + 0.4 * (0.5 * 3.0)) + 2.0 * 1.5


def test_the_engines_combine_an_environment_s_reward_with_the_weighted_rule_through_it():
    """`engine_side._final_scores` (where the engines score trajectories): the environment's reward
    plus env.reward_weight x the rule's (already weighted) score; with a weight of 0 the rule is not
    run at all and a trajectory without a reward counts 0."""
    from types import SimpleNamespace

    from rlhf_orch.reward.execution import ScoredBatch
    from rlhf_orch.transfer.engine_side import _final_scores

    ran = []

    def scorer(prompts, responses, on_scored):
        ran.append(len(responses))
        return ScoredBatch([0.5 * 1.0, 0.5 * 0.0, 0.5 * 1.0], 1, 0, 0.25, "boom")

    def job(weight):
        return SimpleNamespace(
            env=SimpleNamespace(reward_weight=weight), scorer=scorer, samples_per_prompt=3, prompts={0: "p"}
        )

    texts = lambda: ["a", "b", "c"]  # noqa: E731
    scored = _final_scores([0, 1, 2], [1, 1, 1], [False] * 3, [1.0, None, 0.25], texts, job(0.4))
    assert scored.scores == [1.0 + 0.4 * 0.5, 0.0 + 0.4 * 0.0, 0.25 + 0.4 * 0.5]
    assert (scored.errors, scored.timeouts, scored.seconds, scored.first_error) == (1, 0, 0.25, "boom") and ran == [3]
    alone = _final_scores([0, 1, 2], [1, 1, 1], [False] * 3, [1.0, None, 0.25], texts, job(0.0))
    assert alone.scores == [1.0, 0.0, 0.25] and ran == [3]


def test_a_rule_node_without_execution_keys_scores_with_the_declared_ones():
    """A rule given by hand (a reward model's nested `rule`) may leave reward.timeout_s and
    reward.pool_size out: the declaration's values, not a TypeError at the run's start."""
    from rlhf_orch.reward.options import RuleRewardConfig
    from rlhf_orch.reward.scoring import build_reward

    rule = build_reward({"_target_": "rlhf_orch.reward.rules.DigitReverseRule"}).rule
    assert (rule.timeout_s, rule.pool_size, rule.weight) == (
        RuleRewardConfig.timeout_s,
        RuleRewardConfig.pool_size,
        1.0,
    )
