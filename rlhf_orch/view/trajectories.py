"""The rollout dump's sequences as the run page shows them: the table's columns, the conversation
(turns as the chat template put them) and the per-token fields the token view colours.

A sequence's turns come from two facts the dump holds exactly: the loss mask (a run of model
tokens is an assistant turn, a run of other tokens after the prompt is what the environment said)
and the chat template's role headers in the text (ChatML's `<|im_start|>role`, Llama 3's
`<|start_header_id|>role<|end_header_id|>`), which name the prompt's turns and an observation's
role. A template with neither shows the prompt as one user turn.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Any

# Role headers of the chat templates in use: where a turn starts, and its role.
ROLE_HEADER = re.compile(r"<\|im_start\|>(\w+)|<\|start_header_id\|>(\w+)<\|end_header_id\|>")
# What may close a turn before the next header: whitespace and end-of-turn tokens (ChatML's,
# Llama 3's -- <|eom_id|> after a tool call --, Gemma's, Phi's, GPT-2's, SentencePiece's, the tiny models').
TURN_CLOSE = re.compile(
    r"^(?:\s|<\|im_end\|>|<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>|<end_of_turn>|<\|end\|>"
    r"|<\|endoftext\|>|</s>|<eos>)*$"
)


def _offsets(pieces: list[str]) -> list[int]:
    """Character offset where each token's text starts in the joined text."""
    out, at = [], 0
    for piece in pieces:
        out.append(at)
        at += len(piece)
    return out


def _headers(pieces: list[str], lo: int, hi: int) -> list[tuple[int, str]]:
    """(token index, role) of each role header starting within tokens [lo, hi)."""
    starts = _offsets(pieces)
    text = "".join(pieces)
    end = starts[hi - 1] + len(pieces[hi - 1]) if hi > lo else 0
    found = []
    for m in ROLE_HEADER.finditer(text, starts[lo] if lo < len(starts) else len(text), end):
        token = bisect.bisect_right(starts, m.start()) - 1
        found.append((max(token, lo), m.group(1) or m.group(2)))
    return found


def segments(pieces: list[str], loss_mask: list[int]) -> list[dict[str, Any]]:
    """The sequence's turns as token ranges: {role, start, end, model, env}; `model` true on the
    runs the model wrote (trained on), `env` on what the environment answered (after the prompt),
    every token in exactly one segment, in order."""
    n = len(pieces)
    first = loss_mask.index(1) if 1 in loss_mask else n
    out: list[dict[str, Any]] = []

    def split_by_headers(lo: int, hi: int, default_role: str) -> None:
        cuts = [(t, role) for t, role in _headers(pieces, lo, hi) if lo <= t < hi]
        if cuts and cuts[0][0] > lo and out and TURN_CLOSE.match("".join(pieces[lo : cuts[0][0]])):
            # What precedes the first header closes the turn before (the template's "\n" after
            # an end-of-turn token): it stays with that turn. Anything else is the environment's.
            out[-1]["end"] = cuts[0][0]
        elif not cuts or cuts[0][0] > lo:
            cuts.insert(0, (lo, default_role))
        for (start, role), nxt in zip(cuts, cuts[1:] + [(hi, "")]):
            if nxt[0] > start:
                out.append({"role": role, "start": start, "end": nxt[0], "model": False})

    split_by_headers(0, first, "user")
    t = first
    while t < n:
        model = bool(loss_mask[t])
        end = t
        while end < n and bool(loss_mask[end]) == model:
            end += 1
        if model:
            out.append({"role": "assistant", "start": t, "end": end, "model": True})
        else:
            split_by_headers(t, end, "tool")
        t = end
    # A template's assistant header before the model's tokens (the generation prompt) opens the
    # model's turn: one turn, as the template renders it (the token view still shows the mask).
    merged: list[dict[str, Any]] = []
    for seg in out:
        if seg["model"] and merged and merged[-1]["role"] == "assistant" and not merged[-1]["model"]:
            seg = {**seg, "start": merged.pop()["start"]}
        merged.append(seg)
    for seg in merged:
        seg["env"] = not seg["model"] and seg["start"] >= first
    return merged


def _compact(line: dict[str, Any]) -> dict[str, Any]:
    """One dumped line as the page holds it (short keys: a long run's page stays small)."""
    tokens = line.get("tokens") or {}
    pieces = tokens.get("text")
    mask = tokens.get("loss_mask")
    record = {
        "i": line.get("index"),
        "traj": line.get("trajectory"),
        "src": line.get("data_source"),
        "turns": line.get("turns"),
        "reward": line.get("reward"),
        "adv": line.get("advantage"),
        "len": line.get("response_tokens"),
        "trunc": line.get("truncated"),
        "err": line.get("errors"),
        "intr": line.get("interrupted"),
        "ver": line.get("weight_version"),
        "env": line.get("env"),
    }
    if isinstance(pieces, list) and isinstance(mask, list) and len(pieces) == len(mask):
        # (the prompt and the response are the pieces before and from the first model token: the
        # page joins them, the file does not hold them twice)
        record["tok"] = {
            "id": tokens.get("ids"),
            "s": pieces,
            "mask": mask,
            "adv": tokens.get("advantage"),
            "elp": tokens.get("engine_logprob"),
            "tlp": tokens.get("trainer_logprob"),
            "ver": tokens.get("weight_version"),
        }
        record["seg"] = segments(pieces, mask)
    else:  # a dump from before per-token fields: the prompt and the response as two turns
        record.update(seg=None, prompt=line.get("prompt", ""), response=line.get("response", ""))
    return record


def read_step(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """A step's dumped sequences as the page holds them, and the number of lines that did not read
    (a kill mid-write; never an exception)."""
    records, bad = [], 0
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return [], 1
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(value, dict):
            records.append(_compact(value))
        else:
            bad += 1
    return records, bad
