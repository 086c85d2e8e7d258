"""Prompts from a reasoning-gym dataset: procedurally generated tasks with their own verifiers.

`data=reasoning_gym data.task=basic_arithmetic` draws training prompts from reasoning-gym's
dataset `basic_arithmetic` (any of its ~100 registered names; `data.task_config` passes the
dataset's own options, e.g. `{min_terms: 2, max_terms: 2}`), renders each question with the
model's chat template under a system prompt, and labels it with the whole dataset entry, which
`reward=reasoning_gym` scores with that dataset's own `score_answer` (peer-exact by construction).
`data.few_shot=k` puts k solved examples of the same dataset (their own stream) before the question
as earlier conversation turns: how a small instruct model learns the `<answer>` format it is scored by.

Entries are generated on demand by index (reasoning-gym seeds each index; some datasets take tens
of milliseconds an entry), from a train stream (`data.seed`) and a held-out stream (its own seed);
any training entry whose question is also held out is skipped, so the splits never overlap.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping, Optional

from rlhf_orch.data.base import ALL_PROMPTS, DataError, Prompt, PromptSource
from rlhf_orch.data.options import ReasoningGymDataConfig
from rlhf_orch.data.sampler import EpochSampler

# The held-out stream's seed is the training seed plus this (reasoning-gym seeds entry i with seed + i,
# so the offset keeps the two index ranges' seeds apart for any dataset size below it).
_EVAL_SEED_OFFSET = 1_000_003_000
# The few-shot examples' stream (data.few_shot): its own seed again, a pool this large.
_FEW_SHOT_SEED_OFFSET = 2_000_006_000
_FEW_SHOT_POOL = 64
# Training entries checked against data.prompt_max_len before the run starts (later ones too long
# for it are skipped and counted).
_PROBE_ENTRIES = 64


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            "data=reasoning_gym needs the reasoning-gym package; run: make setup "
            "(or .venv/bin/pip install 'reasoning-gym==0.1.25')"
        ) from None
    return reasoning_gym


def system_prompt_text(system_prompt: Optional[str]) -> Optional[str]:
    """`data.system_prompt`: a name of reasoning-gym's SYSTEM_PROMPTS (`default`, `direct`,
    `simple`, `DeepSeekZero`, `chain_of_draft`), any other text as is, or None for none. A single
    word that names no prompt is refused (a misspelt name would otherwise become the prompt)."""
    if system_prompt is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS and not any(c.isspace() for c in system_prompt.strip()):
        raise DataError(
            f"data.system_prompt={system_prompt!r} is not one of reasoning-gym's prompts "
            f"({', '.join(SYSTEM_PROMPTS)}); a prompt of your own is text with at least two words"
        )
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


class ReasoningGymTask(PromptSource):
    """An endless seeded stream of one reasoning-gym dataset's entries, plus a held-out set."""

    def __init__(
        self,
        prompt_max_len: int,
        response_max_len: int,
        seed: int,
        task: str,
        task_config: Optional[Mapping[str, Any]] = None,
        size: int = ReasoningGymDataConfig.size,
        eval_size: int = ReasoningGymDataConfig.eval_size,
        system_prompt: Optional[str] = ReasoningGymDataConfig.system_prompt,
        chat_template: bool = True,
        few_shot: int = ReasoningGymDataConfig.few_shot,
    ) -> None:
        if not isinstance(task, str) or not task:
            raise DataError("data.task: name a reasoning-gym dataset, e.g. data.task=basic_arithmetic")
        self.prompt_max_len = prompt_max_len
        self.response_max_len = response_max_len
        self.seed = seed
        self.task = task
        self.task_config = dict(task_config or {})
        self.size = size
        self.eval_size = eval_size
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        if few_shot and not chat_template:
            raise DataError(
                "data.few_shot needs data.chat_template=true (the examples are earlier turns of the conversation)"
            )
        self.few_shot = few_shot
        self._shots: list[dict] = []
        self._tokenizer: Any = None
        self._train: Any = None
        self._held_out: list[Prompt] = []
        self._held_out_questions: set[str] = set()
        self._sampler = EpochSampler(size, seed)
        self.skipped_overlap = 0
        self.skipped_overlong = 0

    # ------------------------------------------------------------------ building prompts
    def _dataset(self, seed: int, size: int) -> Any:
        rg = _import_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        if self.task not in DATASETS:
            close = sorted(n for n in DATASETS if self.task.split("_")[0] in n)[:8]
            hint = f"; close: {', '.join(close)}" if close else ""
            raise DataError(
                f"data.task={self.task!r} is not a reasoning-gym dataset ({len(DATASETS)} are registered{hint})"
            )
        try:
            return rg.create_dataset(self.task, seed=seed, size=size, **self.task_config)
        except (TypeError, ValueError, AssertionError) as e:
            raise DataError(
                f"data.task_config={self.task_config} for data.task={self.task}: {type(e).__name__}: {e}"
            ) from None

    def _examples(self, index: int) -> list[dict]:
        """`data.few_shot` solved examples as earlier turns (user question, assistant answer in
        reasoning-gym's <answer> format), chosen by the entry's index from their own stream."""
        turns: list[dict] = []
        for j in range(self.few_shot):
            shot = self._shots[(index * self.few_shot + j) % len(self._shots)]
            turns += [
                {"role": "user", "content": str(shot["question"])},
                {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"},
            ]
        return turns

    def _prompt(self, entry: Mapping[str, Any]) -> Prompt:
        question = str(entry["question"])
        system = system_prompt_text(self.system_prompt)
        # Which examples: by the entry's index (a hash of its question where a dataset gives none).
        index = (entry.get("metadata") or {}).get("source_index")
        index = int(index) if isinstance(index, int) else zlib.crc32(question.encode())
        messages = (
            ([{"role": "system", "content": system}] if system else [])
            + self._examples(index)
            + [{"role": "user", "content": question}]
        )
        if self.chat_template:
            text = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.template_kwargs
            )
            ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = f"{system}\n{question}" if system else question
            ids = self._tokenizer(text)["input_ids"]
        # The label is the whole entry (question, answer, metadata): score_answer reads what it needs.
        label = {"question": question, "answer": entry["answer"], "metadata": dict(entry.get("metadata") or {})}
        source = str(label["metadata"].get("source_dataset", self.task))
        return Prompt(text=text, label=label, source=source, prompt_ids=tuple(ids), messages=tuple(messages))

    def bind(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._train = self._dataset(self.seed, self.size)
        held = (
            [self._dataset(self.seed + _EVAL_SEED_OFFSET, self.eval_size)[i] for i in range(self.eval_size)]
            if self.eval_size
            else []
        )
        self._held_out_questions = {str(e["question"]) for e in held}
        if self.few_shot:
            # Examples are never held-out questions: an evaluated question would carry its answer.
            shots = self._dataset(self.seed + _FEW_SHOT_SEED_OFFSET, _FEW_SHOT_POOL)
            self._shots = [
                shots[i] for i in range(_FEW_SHOT_POOL) if shots[i]["question"] not in self._held_out_questions
            ]
            if not self._shots:
                raise DataError(
                    f"data.few_shot={self.few_shot}: every example drawn for {self.task} is a held-out question; "
                    "lower data.eval_size or widen data.task_config"
                )
        self._held_out = [self._prompt(e) for e in held]
        probe = [self._prompt(self._train[i]) for i in range(min(_PROBE_ENTRIES, self.size))]
        for what, prompts in (("held-out", self._held_out), ("training", probe)):
            longest = max((len(p.prompt_ids) for p in prompts), default=0)
            if longest > self.prompt_max_len:
                raise DataError(
                    f"data.prompt_max_len={self.prompt_max_len}: a {what} prompt of {self.task} has {longest} tokens "
                    f"(chat template and system prompt included); raise data.prompt_max_len or shorten data.system_prompt"
                )

    def _bound(self) -> Any:
        if self._train is None:
            raise RuntimeError("ReasoningGymTask: call bind(tokenizer) first")
        return self._train

    # ------------------------------------------------------------------ PromptSource
    def sample_prompts(self, n: int) -> list[Prompt]:
        train = self._bound()
        out: list[Prompt] = []
        skipped_in_a_row = 0
        while len(out) < n:
            for i in self._sampler.take(n - len(out)):
                entry = train[i]
                if entry["question"] in self._held_out_questions:
                    self.skipped_overlap += 1  # deterministic: the sampler's next index takes its place
                    skipped_in_a_row += 1
                    continue
                prompt = self._prompt(entry)
                if len(prompt.prompt_ids) > self.prompt_max_len:
                    self.skipped_overlong += 1
                    skipped_in_a_row += 1
                    continue
                out.append(prompt)
                skipped_in_a_row = 0
            if skipped_in_a_row >= self.size:
                raise DataError(
                    f"data.task={self.task}: {self.size} training entries in a row were held out or longer than "
                    f"data.prompt_max_len; lower data.eval_size or widen data.task_config"
                )
        return out

    def eval_prompts(self, limit: int = ALL_PROMPTS) -> list[Prompt]:
        self._bound()
        return list(self._held_out[:limit] if limit else self._held_out)

    def state_dict(self) -> dict:
        return {
            "sampler": self._sampler.state_dict(),
            "skipped_overlap": self.skipped_overlap,
            "skipped_overlong": self.skipped_overlong,
        }

    def load_state_dict(self, state: dict) -> None:
        self._sampler.load_state_dict(state["sampler"])
        self.skipped_overlap = int(state.get("skipped_overlap", 0))
        self.skipped_overlong = int(state.get("skipped_overlong", 0))

    @property
    def num_train_prompts(self) -> Optional[int]:
        return self.size

    def describe(self) -> list[str]:
        config = f" {self.task_config}" if self.task_config else ""
        system = (
            f"system prompt {self.system_prompt!r}"
            if self.system_prompt in _known_prompt_names()
            else ("a system prompt of your own" if self.system_prompt else "no system prompt")
        )
        shots = f", {self.few_shot} solved examples before each question" if self.few_shot else ""
        return [
            f"reasoning-gym {self.task}{config}: {self.size} training entries (seed {self.seed}), "
            f"{len(self._held_out)} held out (disjoint), {system}{shots}"
        ]


def _known_prompt_names() -> tuple[str, ...]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return tuple(SYSTEM_PROMPTS)
