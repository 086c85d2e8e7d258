"""What the model wrote, for people: `<run dir>/rollouts/step_<N>.jsonl` (`logger.rollouts`).

One line per trained sequence, at most `logger.rollouts_per_step` a step (every
`logger.rollouts_every_n_steps`-th step; the lowest sample
indices: whole prompt groups first), with the whole sequence decoded with its special tokens kept
(`text`: exactly what the policy was trained on, chat template included), its `prompt` and
`response` (the response runs from the first model token to the end: in a multi-turn trajectory it
holds the observations between the model's turns), the reward, the mean advantage over the
model's tokens and over each model turn (`turn_advantages`), each turn's reward where they are
placed per turn (`turn_rewards`, env.reward=per_turn), the number of model turns, the data source, and where the tokens came from. The
tokens come from the policy rank that trained them (`PolicyWorker.dumped_sequences`), so the dump shows
what training saw, whatever the transfer. A resumed or restarted run rewrites the steps it runs
again. `data_source` is null where the step's prompts are not known to this process (a rollout a
checkpoint carried over a resume). veRL's `rollout_data_dir` and OpenRLHF's sample dumps are the same idea.

Per token (`tokens`, what the run page colours, `python -m rlhf_orch.view`): the ids, each token's
text (`text`, incremental detokenization: the pieces join to the decoded sequence), the loss mask
(1: a model token, trained on), the advantage it was trained with, the engine's sampling log-prob
and the trainer's log-prob of it (pi_old; null where the rank has none), and the weight version
that sampled it (under pipeline=async a sequence an update reached carries two or more). Values
are rounded to 4 decimals and written without spaces: about 50 bytes a token and ~1 KB a sequence,
so the default 16 sequences of 300 tokens are ~0.25 MB a step (docs/run_page.md). The sequence's `truncated` flag, whether an update
reached it while it generated (`interrupted`) and, for multi-turn trajectories, its environment
counters (`env`) and their error count (`errors`) are on each line too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlhf_orch.transfer.batch import model_turn_spans
from rlhf_orch.transfer.plan import group_of, trajectory_of
from rlhf_orch.transfer.rollout_meta import RolloutMeta


def model_turns(action: Sequence[int]) -> int:
    """Contiguous runs of model tokens: one per model turn (observations break them)."""
    return len(model_turn_spans(action))


# Longest sequence the slow path decodes prefix by prefix (quadratic); past it, token by token.
PREFIX_DECODE_MAX = 2048


def token_texts(tokenizer: Any, ids: Sequence[int], whole: str | None = None) -> list[str]:
    """Each token's text, decoded incrementally (a character split over several byte tokens shows
    on the token that completes it; special tokens kept), so the pieces join to the decoded
    sequence. Uses the fast tokenizer's own streaming decoder where there is one; otherwise the
    growing prefixes' decodes (up to PREFIX_DECODE_MAX tokens), and where neither joins to the
    decoded sequence, each token decoded alone (a view of the tokens, not of the text). `whole`: the
    sequence decoded with its special tokens, when the caller has it."""
    ids = [int(i) for i in ids]
    if whole is None:
        whole = tokenizer.decode(ids, skip_special_tokens=False)
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=False)
        pieces = [stream.step(backend, i) or "" for i in ids]
        if "".join(pieces) == whole:
            return pieces
    if len(ids) <= PREFIX_DECODE_MAX:
        pieces, before = [], ""
        for k in range(len(ids)):
            text = tokenizer.decode(ids[: k + 1], skip_special_tokens=False)
            if text.endswith("\ufffd") and k < len(ids) - 1:  # an unfinished character: a later token shows it
                pieces.append("")
                continue
            if not text.startswith(before):  # a decoder that rewrites what it decoded before
                break
            pieces.append(text[len(before) :])
            before = text
        if "".join(pieces) == whole and len(pieces) == len(ids):
            return pieces
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def token_versions(length: int, first: int, version: int, spans: Sequence[Sequence[int]] | None) -> list[int]:
    """Per token of a sequence whose response starts at `first`: the weight version that sampled
    it (vLLM's `spans` (start, end, version) over the response; prompt tokens and tokens no span
    covers: `version`, the one it started with)."""
    versions = [version] * length
    for start, end, v in spans or ():
        for t in range(first + start, min(first + end, length)):
            versions[t] = int(v)
    return versions


def env_errors(stats: Mapping[str, float] | None) -> int:
    """A trajectory's failed environment or tool calls (errors and timeouts) from its env counters."""
    return int(sum(v for k, v in (stats or {}).items() if k.endswith(("_errors", "_timeouts"))))


class RolloutDump:
    def __init__(self, run_dir: Path, tokenizer: Any, per_step: int, every_n_steps: int) -> None:
        self.dir = Path(run_dir) / "rollouts"
        self.tokenizer = tokenizer
        self.per_step = per_step
        self.every_n_steps = every_n_steps

    def dumps(self, step: int) -> bool:
        """Whether `step` is written (`logger.rollouts_every_n_steps`)."""
        return step % self.every_n_steps == 0

    def pick(self, indices: Sequence[int]) -> list[int]:
        """The sequences a step dumps: the trajectories with the lowest indices (whole groups of one
        prompt first), each with its further sequences (env=agent), at most `per_step` in all."""
        of_trajectory: dict[int, list[int]] = {}
        for i in sorted(indices):
            of_trajectory.setdefault(trajectory_of(i), []).append(i)
        picked: list[int] = []
        for sequences in of_trajectory.values():
            picked += sequences
            if len(picked) >= self.per_step:
                break
        return picked[: self.per_step]

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}.jsonl"

    def write(
        self,
        step: int,
        sequences: Sequence[Mapping[str, Any]],
        meta: RolloutMeta,
        prompts: Sequence[Any] | None,
        samples_per_prompt: int,
    ) -> Path:
        """`sequences`: what the policy ranks returned (`trained_sequences`); `meta`: the step's
        rollout record (rewards, truncation, weight versions, env counters, by sample index);
        `prompts`: the step's prompt objects by prompt index (their data source), when known."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        row_of = {index: r for r, index in enumerate(meta.indices)}
        lines = []
        for seq in sorted(sequences, key=lambda s: s["index"]):
            ids, action = list(seq["ids"]), list(seq["action"])
            first = action.index(1) if 1 in action else len(ids)
            index = int(seq["index"])
            r = row_of.get(index)
            prompt_index = group_of(index, samples_per_prompt)
            prompt = prompts[prompt_index] if prompts is not None and prompt_index < len(prompts) else None
            env = meta.env_stats[r] if r is not None else None
            version = int(seq.get("weight_version") or 0)
            text = decode(ids)
            lines.append(
                {
                    "step": step,
                    "index": index,
                    "trajectory": trajectory_of(index),
                    "data_source": getattr(prompt, "source", None),
                    "turns": model_turns(action),
                    "reward": meta.rewards[r] if r is not None else None,
                    "advantage": seq["advantage"],
                    "turn_advantages": seq.get("turn_advantages"),
                    **({"turn_rewards": seq["turn_rewards"]} if "turn_rewards" in seq else {}),
                    "response_tokens": sum(action),
                    "weight_version": version,
                    "truncated": bool(meta.truncated[r]) if r is not None else None,
                    "interrupted": bool(meta.interrupted[r]) if r is not None else None,
                    "errors": env_errors(env),
                    "env": env,
                    "prompt": decode(ids[:first]),
                    "response": decode(ids[first:]),
                    "text": text,
                    "tokens": {
                        "ids": ids,
                        "text": token_texts(self.tokenizer, ids, text),
                        "loss_mask": action,
                        "advantage": seq.get("token_advantages"),
                        "engine_logprob": seq.get("engine_logprobs"),
                        "trainer_logprob": seq.get("trainer_logprobs"),
                        "weight_version": token_versions(
                            len(ids), first, version, meta.version_spans[r] if r is not None else None
                        ),
                    },
                }
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
        os.replace(tmp, path)  # a reader (or a crash) never sees half a step
        return path
