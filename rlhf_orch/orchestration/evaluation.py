"""Held-out evaluation on the engines with their current weights, scored by the run's own reward.

`Evaluator.run` sends the validation prompts to the engines (k samples each, greedy at temperature
0), the engines score with the rule where the samples are and return only lengths and scores; with
a reward model the engines hold the samples and hand one packed piece per reward-model rank, which
scores them actor to actor (the training path's `cut_for_ranks` / `stage_pieces`). The driver
computes, per data source, mean@k (the mean score) and pass@k (the fraction of prompts with at
least one sample scoring >= `pass_threshold`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.reward.scoring import RewardSetup
from rlhf_orch.transfer.base import merge_meta
from rlhf_orch.transfer.engine_side import RolloutJob, RolloutMeta
from rlhf_orch.transfer.plan import pieces_per_engine, plan_packed, prompt_chunks, whole_prompt_requests

# Shard ids the reward model stages evaluation pieces under (training shards are 0..ranks-1).
_EVAL_SHARD_BASE = 1_000_000


@dataclass(frozen=True)
class EvalSettings:
    every_n_steps: int
    before_train: bool
    samples_per_prompt: int
    temperature: float
    pass_threshold: float
    max_tokens: int


def eval_metrics(prompts: Sequence[Prompt], scores: Sequence[float], k: int, pass_threshold: float) -> dict[str, float]:
    """`eval/<source>/mean@k` and `eval/<source>/pass@k` (pure: scores[i] belongs to prompt i // k)."""
    if len(scores) != len(prompts) * k:
        raise ValueError(f"{len(scores)} scores for {len(prompts)} prompts x {k} samples")
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for p, prompt in enumerate(prompts):
        by_source[prompt.source].append(list(scores[p * k : (p + 1) * k]))
    out = {}
    for source, groups in sorted(by_source.items()):
        flat = [s for g in groups for s in g]
        out[f"eval/{source}/mean@{k}"] = sum(flat) / len(flat)
        out[f"eval/{source}/pass@{k}"] = sum(max(g) >= pass_threshold for g in groups) / len(groups)
    return out


class Evaluator:
    def __init__(
        self, settings: EvalSettings, prompts: list[Prompt], reward: RewardSetup, get: Callable[..., list[Any]], env: Any = None
    ):
        self.env = env  # multi-turn rollouts: held-out prompts are played as trajectories too
        self.settings = settings
        self.prompts = prompts
        self.reward = reward
        self._get = get

    @property
    def uses_engine_buffers(self) -> bool:
        """Scoring with a reward model holds the samples on the engines (`produce_and_hold`)."""
        return self.reward.has_model

    def should_run(self, step: int) -> bool:
        """Step 0 is "before training"; then every `every_n_steps` steps."""
        if not self.prompts:
            return False
        if step == 0:
            return self.settings.before_train
        n = self.settings.every_n_steps
        return n > 0 and step % n == 0

    def run(self, engines: Sequence[Any], reward_ranks: Sequence[Any]) -> dict[str, float]:
        s = self.settings
        t = time.perf_counter()
        job_prompts = {i: p for i, p in enumerate(self.prompts)}
        chunks = [c for c in prompt_chunks(len(self.prompts), len(engines))]
        used = [(e, c) for e, c in zip(engines, chunks) if len(c)]

        def job(chunk) -> RolloutJob:
            return RolloutJob(
                prompt_ids={i: list(self.prompts[i].prompt_ids) for i in chunk},
                prompts={i: job_prompts[i] for i in chunk},
                samples_per_prompt=s.samples_per_prompt,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                scorer=self.reward.rule,
                env=self.env,
            )

        requests = [whole_prompt_requests(c, s.samples_per_prompt) for _, c in used]
        if self.reward.has_model:
            meta = self._with_reward_model(used, requests, job, reward_ranks)
        else:
            parts = self._get([e.produce_scores.remote(r, job(c)) for (e, c), r in zip(used, requests)], "evaluating", engine_call=True)
            meta = merge_meta(parts)
        metrics = eval_metrics(self.prompts, meta.trajectories_only().rewards, s.samples_per_prompt, s.pass_threshold)
        metrics["eval/response_mean_len"] = sum(meta.response_lens) / max(len(meta.response_lens), 1)
        metrics["time/eval"] = time.perf_counter() - t
        return metrics

    def _with_reward_model(self, used, requests, job, reward_ranks) -> RolloutMeta:
        held = self._get([e.produce_and_hold.remote(r, job(c)) for (e, c), r in zip(used, requests)], "evaluating", engine_call=True)
        meta = merge_meta(held)
        ranks = len(reward_ranks)
        budget = max(meta.seq_lens) * self.reward.model.micro_batch_size
        plan = plan_packed(meta.indices, meta.seq_lens, budget, ranks)
        cut = pieces_per_engine(plan, [m.indices for m in held])
        pieces = []
        for (engine, _), members in zip(used, cut):
            refs = engine.cut_for_ranks.options(num_returns=ranks).remote(members)
            pieces.append([refs] if ranks == 1 else list(refs))
        shard = [_EVAL_SHARD_BASE + r for r in range(ranks)]
        self._get([rm.stage_pieces.remote(shard[r], plan[r], [p[r] for p in pieces]) for r, rm in enumerate(reward_ranks)], "evaluating")
        scored = self._get([rm.score.remote(shard[r]) for r, rm in enumerate(reward_ranks)], "evaluating")
        model_score = {i: v for indices, values in scored for i, v in zip(indices, values)}
        rule = meta.rewards if self.reward.rule is not None else [0.0] * len(meta.rewards)
        meta.rewards = [r + self.reward.model.weight * model_score[i] for r, i in zip(rule, meta.indices)]
        meta.share_trajectory_rewards()
        return meta
