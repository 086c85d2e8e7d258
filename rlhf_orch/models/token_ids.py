"""Whether a second model (a teacher, a reward model) reads the policy's token ids as the policy
does: it scores the policy's ids as they are, so its tokenizer must map each id to the same text."""

from __future__ import annotations

from typing import Any


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
