"""Everything a run reads, made ready and checked on the driver before Ray starts.

The model (built or found offline), its tokenizer, the teacher (built or found, on the policy's
tokenizer), the data (loaded, templated, tokenized,
filtered), the reward (a user's file loaded, labels present where the rule needs them) and the
reward model (built or found, checked to be a one-label sequence classifier on the policy's
tokenizer). Anything wrong here is an `InputError`: one line, exit status 2, no actor started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.data.base import DataError, Prompt, PromptSource
from rlhf_orch.env.base import EnvError, EnvGroup
from rlhf_orch.models.hub import ModelSourceError
from rlhf_orch.models.teacher import check_teacher
from rlhf_orch.reward.base import RewardError
from rlhf_orch.reward.model import RewardModelError
from rlhf_orch.reward.scoring import RewardSetup, build_reward


class InputError(ValueError):
    """The model, data or reward cannot be used; the message is one line with the key and the fix."""


@dataclass
class RunInputs:
    model: Any
    model_path: str
    tokenizer: Any
    task: PromptSource
    reward: RewardSetup
    reward_model_path: str | None
    eval_prompts: list[Prompt]
    notes: list[str] = field(default_factory=list)  # lines worth printing at start (filtered rows, ...)
    env: EnvGroup | None = None  # the `env` option (multi-turn rollouts when env.multi_turn)
    teacher_path: str | None = None  # teacher=<model option>'s checkpoint (None: no teacher)


def prepare_inputs(cfg: DictConfig, typed: RootConfig) -> RunInputs:
    try:
        return _prepare(cfg, typed)
    except (DataError, ModelSourceError, RewardModelError, RewardError, EnvError) as e:
        raise InputError(str(e)) from None


def _prepare(cfg: DictConfig, typed: RootConfig) -> RunInputs:
    model = instantiate(cfg.model)
    model_path = model.ready()  # a hub id loadable offline; the tiny model built on first use
    tokenizer = model.tokenizer()
    # (validate refused a teacher that no algorithm term reads, and a teacher term without one)
    teacher_path = check_teacher(instantiate(cfg.teacher), tokenizer) if typed.teacher is not None else None

    task: PromptSource = instantiate(cfg.data)
    env: EnvGroup = instantiate(cfg.env)
    # The prompts rendered as the environment's turns continue them (env.chat_template_kwargs: tools,
    # enable_thinking), so data.prompt_max_len checks the prompt the policy is given, here.
    task.render_prompts_with(env.prompt_template_kwargs())
    task.bind(tokenizer)
    notes = [f"data: {line}" for line in task.describe()]

    # With an environment the reward group counts only at env.reward_weight != 0.
    uses_reward_group = not env.multi_turn or bool(getattr(env, "reward_weight", 0.0))
    if env.multi_turn:
        env.bind(task)
        check_env(env, task, tokenizer)
        notes += env.describe()

    reward = build_reward(cfg.reward)
    if reward.rule is not None and uses_reward_group:
        reward.rule.fn.check()
        missing = task.missing_labels()
        if reward.needs_label and missing:
            raise InputError(
                f"reward={reward.rule.name} needs a label for every prompt and {missing} training prompts have none; "
                "set data.label_key to the column holding the ground truth (or use a reward that needs none, e.g. reward=custom)"
            )
    reward_model_path = None
    if reward.model is not None:
        reward_model_path = reward.model.resolve(model)
        reward.model.check(reward_model_path, tokenizer)
    if uses_reward_group:
        notes.append(f"reward: {reward.describe()}")

    evaluating = typed.eval.enabled
    eval_prompts = task.eval_prompts(typed.eval.num_prompts) if evaluating else []
    if evaluating and not eval_prompts:
        raise InputError(
            "eval.every_n_steps/eval.before_train are set but the data has no held-out prompts; "
            "set data.val_files=[...] or turn evaluation off (eval.every_n_steps=0 eval.before_train=false)"
        )
    return RunInputs(
        model, model_path, tokenizer, task, reward, reward_model_path, eval_prompts, notes, env, teacher_path
    )


def check_env(env: EnvGroup, task: PromptSource, tokenizer: Any) -> None:
    """Before Ray: the environment builds and starts for the first training prompt (a user's
    class or function loads, a skyrl-gym id exists, the observation format suits the tokenizer)."""
    probe = task.eval_prompts(1)
    if not probe:
        state = task.state_dict()
        probe = task.sample_prompts(1)
        task.load_state_dict(state)  # the probe draws nothing a run would see
    try:
        env.check(probe[0], tokenizer)
    except EnvError:
        raise
    except Exception as e:  # the user's class or the row, in one line
        raise EnvError(f"env: building the environment for the first prompt failed: {type(e).__name__}: {e}") from e
