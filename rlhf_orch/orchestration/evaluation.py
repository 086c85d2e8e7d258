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
from rlhf_orch.reward.combine import sample_reward
from rlhf_orch.reward.scoring import RewardSetup
from rlhf_orch.transfer.base import Route
from rlhf_orch.transfer.engine_side import RolloutJob
from rlhf_orch.transfer.rollout_meta import RolloutMeta
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
        self,
        settings: EvalSettings,
        prompts: list[Prompt],
        reward: RewardSetup,
        get: Callable[..., list[Any]],
        env: Any = None,
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

    def run(self, route: Route, reward_ranks: Sequence[Any]) -> dict[str, float]:
        """The held-out metrics with the engines' current weights. The engines are waited for by
        their progress (`Route.on_engines`): an evaluation of long responses that keeps making
        tokens is never cut by fault.step_timeout_s; a stuck engine is found as in training."""
        s = self.settings
        t = time.perf_counter()
        job_prompts = {i: p for i, p in enumerate(self.prompts)}
        chunks = [c for c in prompt_chunks(len(self.prompts), len(route.engines))]
        used = [e for e, c in enumerate(chunks) if len(c)]

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

        produce = "produce_and_hold" if self.reward.has_model else "produce_scores"
        made = route.on_engines(
            lambda e, engine: getattr(engine, produce).remote(
                whole_prompt_requests(chunks[e], s.samples_per_prompt), job(chunks[e])
            ),
            used,
            "evaluating",
        )
        parts = [made[e] for e in used]
        meta = (
            self._scored_by_reward_model(route, used, parts, reward_ranks)
            if self.reward.has_model
            else RolloutMeta.merge(parts)
        )
        metrics = eval_metrics(self.prompts, meta.trajectories_only().rewards, s.samples_per_prompt, s.pass_threshold)
        metrics["eval/response_mean_len"] = sum(meta.response_lens) / max(len(meta.response_lens), 1)
        metrics["time/eval"] = time.perf_counter() - t
        return metrics

    def _scored_by_reward_model(
        self, route: Route, used: list[int], held: list[RolloutMeta], reward_ranks
    ) -> RolloutMeta:
        """Samples the engines `used` hold (`held`: their metadata), scored by the reward-model ranks."""
        meta = RolloutMeta.merge(held)
        ranks = len(reward_ranks)
        budget = max(meta.seq_lens) * self.reward.model.micro_batch_size
        plan = plan_packed(meta.indices, meta.seq_lens, budget, ranks, steps=1)  # (scored only: one pass)
        cut = pieces_per_engine(plan, [m.indices for m in held])
        pieces = []
        for e, members in zip(used, cut):
            refs = route.engines[e].cut_for_ranks.options(num_returns=ranks).remote(members)
            pieces.append([refs] if ranks == 1 else list(refs))
        shard = [_EVAL_SHARD_BASE + r for r in range(ranks)]
        self._get(
            [rm.stage_pieces.remote(shard[r], plan[r], [p[r] for p in pieces]) for r, rm in enumerate(reward_ranks)],
            "evaluating",
        )
        scored = self._get(
            [rm.score.remote(shard[r]) for r, rm in enumerate(reward_ranks)],
            "evaluating",
            progress_of={f"reward-model rank {r}": rm for r, rm in enumerate(reward_ranks)},
        )  # (by their progress)
        model_score = {i: v for indices, values in scored for i, v in zip(indices, values)}
        rule = meta.rewards if self.reward.rule is not None else [0.0] * len(meta.rewards)
        meta.rewards = [
            sample_reward(r, 1.0, model=model_score[i], model_weight=self.reward.model.weight)
            for r, i in zip(rule, meta.indices)
        ]
        meta.share_trajectory_rewards()
        return meta
