"""Where the policy's old log-probs (pi_old, before the update) come from (`trainer.old_logprobs`).

The experience phase computes them with a forward of its own, without gradients
(`experience.make_experience`). With one optimizer step per rollout (one epoch, the whole
rollout in one step) the update's own forward runs on the same weights, so its log-probs,
detached, are pi_old (what TRL uses) -- provided nothing read them before the update (a KL penalty
in the reward and a teacher's term read them to make the advantages) and the two forwards compute the same function
(dropout in training mode would draw another mask in the update). Then the separate forward is
work done twice (on SmolLM2, up to 40 % of a step) and is skipped: `old_logprobs_from_update`
decides, once per step, from the same optimizer-step plan the update uses.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rlhf_orch.trainer.options import OLD_LOGPROBS_MODES

#: The reason when the update's forward gives them.
FROM_UPDATE = (
    "from the update's own forward (one optimizer step per rollout, no KL in the reward or teacher term, no dropout)"
)


def old_logprobs_from_update(
    mode: str, ppo_epochs: int, optimizer_steps: int, kl_in_reward: bool, dropout: str | None, teacher: bool = False
) -> tuple[bool, str]:
    """Whether the update's detached log-probs serve as pi_old (no separate forward), and why (not).

    `optimizer_steps`: optimizer steps of one epoch over the rollout (`plan_optimizer_steps`);
    `kl_in_reward` / `teacher`: the algorithm's token targets read pi_old (`Algorithm._reward_kl`,
    the teacher's term `Algorithm.targets`); `dropout`:
    where the trained model has dropout active in training mode (`active_dropout`), None where none.
    """
    if mode not in OLD_LOGPROBS_MODES:
        raise ValueError(f"trainer.old_logprobs={mode!r}: use one of {list(OLD_LOGPROBS_MODES)}")
    # The first reason that holds: each makes the update's log-probs differ from pi_old.
    fallbacks = (
        (mode == "forward", "trainer.old_logprobs=forward"),
        (
            ppo_epochs > 1,
            f"algo.ppo_epochs={ppo_epochs}: later epochs run on weights the first one moved",
        ),
        (
            optimizer_steps > 1,
            f"{optimizer_steps} optimizer steps per epoch (algo.train_batch_size below the rollout's sequences): "
            "later steps run on moved weights",
        ),
        (kl_in_reward, "the KL penalty in the reward reads them before the update (algo.kl_placement=in_reward)"),
        (teacher, "the teacher's term reads them before the update (algo.distill_coef)"),
        (dropout is not None, f"dropout is active in training ({dropout}): the update's forward draws its own mask"),
    )
    for applies, reason in fallbacks:
        if applies:
            return False, f"a forward of their own: {reason}"
    return True, FROM_UPDATE


#: Parts of a Hugging Face config key whose value > 0 makes training mode random: dropout in its
#: names (`attention_dropout`, `resid_pdrop`), skipped layers (`layerdrop`), stochastic depth
#: (`drop_path_rate`), a mixture-of-experts router's jitter (`router_jitter_noise`).
STOCHASTIC_KEY_PARTS = ("dropout", "pdrop", "layerdrop", "drop_path", "jitter")
#: Keys of heads a causal language model does not run (GPT-NeoX's `classifier_dropout`, GPT-2's
#: `summary_first_dropout`): the policy's forward never draws their masks.
UNUSED_HEAD_PREFIXES = ("classifier", "summary_")


def active_dropout(model: nn.Module) -> str | None:
    """Where `model` is random in training mode, named (None: nowhere): a dropout layer with p > 0
    (LoRA's lora_dropout among them), or a model config's value > 0 under a key with a part of
    `STOCHASTIC_KEY_PARTS` (Hugging Face attention applies `attention_dropout` functionally, with no
    layer to find)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name or type(module).__name__} p={module.p:g}"
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        found = _dropout_in(config.to_dict())
        if found is not None:
            return f"model config {found}"
    return None


def _dropout_in(values: dict[str, Any], prefix: str = "") -> str | None:
    """The first number > 0 under a `STOCHASTIC_KEY_PARTS` key of a config's dict (nested configs too)."""
    for key, value in values.items():
        key = str(key)  # (id2label's keys are ints)
        if isinstance(value, dict):
            found = _dropout_in(value, f"{prefix}{key}.")
            if found is not None:
                return found
        elif (
            any(part in key for part in STOCHASTIC_KEY_PARTS)
            and not key.startswith(UNUSED_HEAD_PREFIXES)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value > 0
        ):
            return f"{prefix}{key}={value:g}"
    return None
