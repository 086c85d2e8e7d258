"""The teacher (teacher=<model option>) beside the policy: it scores the policy's token ids, so
both must read ids the same way -- refused before anything starts otherwise."""

from __future__ import annotations

from typing import Any

from rlhf_orch.models.source_error import ModelSourceError


class TeacherTokenizerError(ModelSourceError):
    """The teacher's tokenizer maps token ids to other text than the policy's."""


def tokenizer_mismatch(policy: Any, teacher: Any) -> str | None:
    """Why `teacher` (a tokenizer) cannot score `policy`'s token ids, or None when it can: every
    token of either vocabulary under the same id in the other, and the same end-of-sequence id
    (the teacher would otherwise read another text, or another end, from the same ids)."""
    ours, theirs = policy.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"{len(theirs)} tokens against the policy's {len(ours)}"
    differ = sorted(tok for tok, i in ours.items() if theirs.get(tok) != i)
    if differ:
        return f"{len(differ)} of {len(ours)} tokens under other ids (e.g. {differ[0]!r})"
    if policy.eos_token_id != teacher.eos_token_id:
        return f"end-of-sequence id {teacher.eos_token_id} against the policy's {policy.eos_token_id}"
    return None


def check_teacher(teacher: Any, policy_tokenizer: Any) -> str:
    """The teacher model option (`rlhf_orch.models.base` API) made ready: found or built offline,
    its context long enough, its tokenizer the policy's. Returns its checkpoint path."""
    check = getattr(teacher, "check", None)
    if check is not None:
        check()
    path = teacher.path()
    teacher.check_context_len()
    why = tokenizer_mismatch(policy_tokenizer, teacher.tokenizer())
    if why is not None:
        raise TeacherTokenizerError(
            f"teacher ({teacher.model_id}): its tokenizer is not the policy's ({why}); the teacher scores "
            "the policy's token ids, so pick a teacher of the policy's family (the same tokenizer)"
        )
    return path
