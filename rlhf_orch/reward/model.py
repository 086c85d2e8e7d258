"""`reward=model`: a sequence-classification reward model as a role of its own.

The planner gives it ranks (one beside each critic rank, or its own when the algorithm has no
critic); each rank stages the same experience shards the trainers receive (it is one more consumer
on the transfer's route, so every transfer strategy feeds it actor to actor) and returns one score
per sequence: the score head at the sequence's last token, as Hugging Face's
`*ForSequenceClassification` computes it. The driver receives only those floats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_orch.models.hub import resolve_local_checkpoint
from rlhf_orch.models.token_ids import tokenizer_mismatch


class RewardModelError(ValueError):
    """The reward model cannot be used (one line: key, value, fix); raised before Ray starts."""


class RewardModel:
    """The `_target_` of `reward=model`: where the checkpoint is and how its score is weighted."""

    def __init__(self, model_path: str | None, weight: float, rule_weight: float, micro_batch_size: int):
        if micro_batch_size < 1:
            raise ValueError(f"reward.micro_batch_size={micro_batch_size}: must be >= 1")
        self.model_path = model_path
        self.weight = weight
        self.rule_weight = rule_weight
        self.micro_batch_size = micro_batch_size

    def resolve(self, policy: Any) -> str:
        """A local checkpoint directory of the reward model (built first when it is the tiny one)."""
        if self.model_path is None:
            build = getattr(policy, "reward_model_path", None)
            if build is None:
                raise RewardModelError(
                    f"reward.model_path=null: only model=tiny builds a reward model locally; give "
                    f"reward.model_path=<sequence-classification checkpoint> for model {policy.model_id}"
                )
            return build()
        return resolve_local_checkpoint(self.model_path, "reward.model_path")

    def check(self, path: str, policy_tokenizer: Any) -> None:
        """Refuse what cannot serve as a reward model for this policy, before any actor starts."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise RewardModelError(
                f"reward.model_path={path!r}: no config.json there; give a Hugging Face checkpoint directory"
            )
        config = json.loads(config_file.read_text())
        architectures = config.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise RewardModelError(
                f"reward.model_path={path!r} is a {', '.join(architectures) or 'model without architectures'} "
                "checkpoint, not a sequence-classification one; give a *ForSequenceClassification checkpoint with one label"
            )
        labels = config.get("num_labels", len(config.get("id2label", {}) or {}) or 1)
        if labels != 1:
            raise RewardModelError(
                f"reward.model_path={path!r} has {labels} labels; a reward model has exactly one (a scalar score)"
            )
        from transformers import AutoTokenizer

        # The reward model reads the policy's token ids as they are: the vocabularies must agree.
        why = tokenizer_mismatch(policy_tokenizer, AutoTokenizer.from_pretrained(path))
        if why is not None:
            raise RewardModelError(
                f"reward.model_path={path!r} has a different tokenizer than the policy ({why}); the reward model "
                "scores the policy's token ids, so use one trained with the policy's tokenizer"
            )
