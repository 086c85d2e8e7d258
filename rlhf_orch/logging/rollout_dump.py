"""What the model wrote, for people: `<run dir>/rollouts/step_<N>.jsonl` (`logger.rollouts`).

One line per trained sequence, at most `logger.rollouts_per_step` a step (every
`logger.rollouts_every_n_steps`-th step; the lowest sample
indices: whole prompt groups first), with the whole sequence decoded with its special tokens kept
(`text`: exactly what the policy was trained on, chat template included), its `prompt` and
`response` (the response runs from the first model token to the end: in a multi-turn trajectory it
holds the observations between the model's turns), the reward, the mean advantage over the
model's tokens and over each model turn (`turn_advantages`), each turn's reward where they are
placed per turn (`turn_rewards`, env.reward=per_turn), the number of model turns, the data source, and where the tokens came from. The
tokens come from the policy rank that trained them (`PolicyWorker.sequences`), so the dump shows
what training saw, whatever the transfer. A resumed or restarted run rewrites the steps it runs
again. `data_source` is null where the step's prompts are not known to this process (a rollout a
checkpoint carried over a resume). veRL's `rollout_data_dir` and OpenRLHF's sample dumps are the same idea.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlhf_orch.transfer.batch import model_turn_spans
from rlhf_orch.transfer.plan import group_of, trajectory_of


def model_turns(action: Sequence[int]) -> int:
    """Contiguous runs of model tokens: one per model turn (observations break them)."""
    return len(model_turn_spans(action))


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
        rewards: Mapping[int, float],
        prompts: Sequence[Any] | None,
        samples_per_prompt: int,
    ) -> Path:
        """`sequences`: what the policy ranks returned (index, ids, action, advantage, weight_version);
        `prompts`: the step's prompt objects by prompt index (their data source), when known."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        lines = []
        for seq in sorted(sequences, key=lambda s: s["index"]):
            ids, action = list(seq["ids"]), list(seq["action"])
            first = action.index(1) if 1 in action else len(ids)
            index = int(seq["index"])
            prompt_index = group_of(index, samples_per_prompt)
            prompt = prompts[prompt_index] if prompts is not None and prompt_index < len(prompts) else None
            lines.append(
                {
                    "step": step,
                    "index": index,
                    "trajectory": trajectory_of(index),
                    "data_source": getattr(prompt, "source", None),
                    "turns": model_turns(action),
                    "reward": rewards.get(index),
                    "advantage": seq["advantage"],
                    "turn_advantages": seq.get("turn_advantages"),
                    **({"turn_rewards": seq["turn_rewards"]} if "turn_rewards" in seq else {}),
                    "response_tokens": sum(action),
                    "weight_version": seq.get("weight_version"),
                    "prompt": decode(ids[:first]),
                    "response": decode(ids[first:]),
                    "text": decode(ids),
                }
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)  # a reader (or a crash) never sees half a step
        return path
