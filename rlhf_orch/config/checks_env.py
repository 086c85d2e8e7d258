"""Cross-key checks of multi-turn rollouts: a turn fits the trajectory's budget, the engines score
what they generate, per-turn rewards reach an algorithm that reads them, observations continue the
prompts' rendering, the option's own host and data checks (`rlhf_orch.config.validate.CHECKS` runs it)."""

from __future__ import annotations

from hydra.utils import get_class

from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.ranges import is_int
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.env.options import AgentEnvConfig, MultiTurnEnvConfig
from rlhf_orch.reward.options import ModelRewardConfig
from rlhf_orch.topology.plan import PlacementPlan


# The env options whose rollouts are trajectories the engines drive (their rewards are made there).
TRAJECTORY_ENVS = (MultiTurnEnvConfig, AgentEnvConfig)


def env(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """Multi-turn rollouts: a turn fits the trajectory's budget, the engines score what they
    generate (the environments live there), and the reward is one the engines can finish."""
    env = cfg.env
    if not isinstance(env, TRAJECTORY_ENVS):
        return []
    problems = []
    budget = cfg.data.response_max_len
    if is_int(env.max_tokens_per_turn) and env.max_tokens_per_turn > budget:
        problems.append(
            Problem(
                "env.max_tokens_per_turn",
                env.max_tokens_per_turn,
                f"a turn must fit the whole trajectory's budget data.response_max_len={budget}; "
                f"set env.max_tokens_per_turn <= {budget} or raise data.response_max_len",
            )
        )
    if not getattr(get_class(cfg.transfer._target_), "scores_on_engines", True):
        problems.append(
            Problem(
                "transfer",
                cfg.transfer._target_.rsplit(".", 1)[-1],
                "the padded baseline scores rollouts on the driver, and a trajectory's reward comes from its environment, "
                "which lives on the engine that played it; use transfer=packed or transfer=micro_batched",
            )
        )
    if getattr(env, "reward", None) == "per_turn":
        # refused where it would place every reward on the last token anyway (the same as sum)
        if not cfg.algo.per_token_rewards:
            why = (
                f"algo {cfg.algo._target_.rsplit('.', 1)[-1]} gives a trajectory one advantage from one score, so "
                "per-turn rewards would only add up: use env.reward=sum, or an algorithm whose advantages read "
                "rewards per token (algo=ppo, reinforce_pp, reinforce_pp_baseline)"
            )
        elif not env.rewards_each_turn:
            why = (
                f"env {env._target_.rsplit('.', 1)[-1]} rewards only the final answer, so every reward would sit on "
                "the last token: use env.reward=sum"
            )
        elif env.max_turns == 1:
            why = "with env.max_turns=1 the only turn's reward sits on the last token: use env.reward=sum"
        else:
            why = None
        if why:
            problems.append(Problem("env.reward", "per_turn", why))
    raw = cfg.data.raw_prompts()
    if env.continues_chat_template and raw:
        problems.append(
            Problem(
                "env.observation_format",
                "chat_template",
                f"observations are the chat template's text after each turn, but {raw}, not the template's rendering: every "
                "trajectory's context would differ from the template's at token 0; set env.observation_format=plain, or use "
                "chat-templated prompts (data=files or data=reasoning_gym with data.chat_template=true)",
            )
        )
    host_problems = getattr(get_class(env._target_), "host_problems", None)
    if host_problems is not None:  # e.g. env=python_tool: this host's sandbox (probed here, before Ray)
        problems += [Problem(key, value, why) for key, value, why in host_problems(env)]
    config_problems = getattr(get_class(env._target_), "config_problems", None)
    if (
        config_problems is not None
    ):  # e.g. env=skyrl: environments running the model's code, the rows' env_class read here
        problems += [Problem(key, value, why) for key, value, why in config_problems(env, cfg.data)]
    if isinstance(cfg.reward, ModelRewardConfig):
        problems.append(
            Problem(
                "reward",
                "model",
                "a reward model scores after the hand-over and would replace the environments' rewards the engines "
                "attached; with env, score the transcript with a rule or reward=custom (env.reward_weight) instead",
            )
        )
    return problems
