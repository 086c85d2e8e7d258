"""The teacher (teacher=<model option>) beside the policy: it scores the policy's token ids, so
both must read ids the same way -- refused before anything starts otherwise."""

from __future__ import annotations

from typing import Any

from rlhf_orch.models.source_error import ModelSourceError
from rlhf_orch.models.token_ids import tokenizer_mismatch


class TeacherTokenizerError(ModelSourceError):
    """The teacher's tokenizer maps token ids to other text than the policy's."""


def check_teacher(teacher: Any, policy_tokenizer: Any) -> str:
    """The teacher model option (`rlhf_orch.models.base` API) made ready: found or built offline,
    its context long enough, its tokenizer the policy's. Returns its checkpoint path."""
    path = teacher.ready()
    why = tokenizer_mismatch(policy_tokenizer, teacher.tokenizer())
    if why is not None:
        raise TeacherTokenizerError(
            f"teacher ({teacher.model_id}): its tokenizer is not the policy's ({why}); the teacher scores "
            "the policy's token ids, so pick a teacher of the policy's family (the same tokenizer)"
        )
    return path
