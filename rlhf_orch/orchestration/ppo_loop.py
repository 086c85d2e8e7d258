"""The PPO loop, readable top to bottom: generate -> score -> hand over -> experience -> train -> sync.

The driver holds prompts, token ids of the responses and scalar rewards; the experience tensors
move between actors as Ray object references (the driver never materialises them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from rlhf_orch.algo.experience import AdvantageSettings
from rlhf_orch.orchestration.actors import RoleActors
from rlhf_orch.sync.base import WeightSync
from rlhf_orch.transfer.base import RolloutTransfer
from rlhf_orch.transfer.batch import Sample


class EngineDiedError(RuntimeError):
    """A vLLM engine died mid-run."""


@dataclass
class LoopSettings:
    num_steps: int
    rollout_batch_size: int
    samples_per_prompt: int
    micro_batch_size: int
    response_max_len: int
    temperature: float
    seed: int
    step_timeout_s: float


class PPOLoop:
    def __init__(
        self,
        actors: RoleActors,
        task: Any,
        tokenizer: Any,
        transfer: RolloutTransfer,
        sync: WeightSync,
        advantage: AdvantageSettings,
        settings: LoopSettings,
    ):
        self.actors = actors
        self.task = task
        self.tokenizer = tokenizer
        self.transfer = transfer
        self.sync = sync
        self.advantage = advantage
        self.settings = settings
        self.version = 0

    # ------------------------------------------------------------------ one PPO step
    def step(self, step: int) -> dict[str, Any]:
        s = self.settings
        timings: dict[str, float] = {}
        t_step = time.perf_counter()

        # 1. Generate: prompts split over engines, each engine samples `samples_per_prompt` each.
        t = time.perf_counter()
        prompts = self.task.sample_prompts(s.rollout_batch_size, step)
        generations = self._generate(prompts, step)
        timings["generate"] = time.perf_counter() - t

        # 2. Score with the rule (cheap, on the driver: it needs only text).
        t = time.perf_counter()
        samples = self._score(prompts, generations)
        timings["reward"] = time.perf_counter() - t

        # 3. Hand over: each data-parallel shard goes once to every worker that needs it.
        t = time.perf_counter()
        handover = self.transfer.hand_over(samples, len(self.actors.policy), s.micro_batch_size, self.tokenizer.pad_token_id)
        shards = handover.shard_refs
        self._get(self._stage_calls(shards), "handing experience to the trainers")
        timings["transfer"] = time.perf_counter() - t

        # 4. Experience: reference logprobs and values (object refs), then old logprobs + GAE
        #    on the policy ranks, which pass the critic its returns.
        t = time.perf_counter()
        ref_lp = [self._reference_for(i).logprobs.remote(i) for i in range(len(shards))]
        values = [self._critic_for(i).values.remote(i) for i in range(len(shards))]
        made = [
            rank.make_experience.options(num_returns=2).remote(i, ref_lp[i], values[i], self.advantage)
            for i, rank in enumerate(self.actors.policy)
        ]
        exp_stats = self._get([m[0] for m in made], "computing experience")
        returns = [m[1] for m in made]
        timings["experience"] = time.perf_counter() - t

        # 5. Train actor and critic concurrently.
        t = time.perf_counter()
        policy_calls = [rank.train.remote(i) for i, rank in enumerate(self.actors.policy)]
        critic_calls = [
            critic.train.remote({i: returns[i] for i in self._shards_of_critic(c, len(shards))})
            for c, critic in enumerate(self.actors.critic)
        ]
        policy_stats = self._get(policy_calls, "training the policy")
        critic_stats = self._get(critic_calls, "training the critic")
        timings["train"] = time.perf_counter() - t

        # 6. Sync: the engines get the new weights and the new version number.
        t = time.perf_counter()
        self.version += 1
        report = self.sync.push(self.version)
        self.sync.verify(self.version)
        timings["sync"] = time.perf_counter() - t
        timings["step"] = time.perf_counter() - t_step

        return self._metrics(step, samples, handover, exp_stats, policy_stats, critic_stats, report, timings)

    # ------------------------------------------------------------------ pieces
    def _generate(self, prompts: Sequence[Any], step: int) -> list[Any]:
        s = self.settings
        engines = self.actors.engines
        encoded = [self.tokenizer(p.text).input_ids for p in prompts]
        chunks = [list(range(len(prompts)))[i :: len(engines)] for i in range(len(engines))]
        calls = [
            engine.generate.remote(
                [encoded[i] for i in chunk], chunk, s.samples_per_prompt, s.response_max_len, s.temperature
            )
            for engine, chunk in zip(engines, chunks)
            if chunk
        ]
        results = self._get(calls, "generating", engine_call=True)
        gens = [g for r in results for g in r]
        gens.sort(key=lambda g: g.prompt_index)  # stable: samples of one prompt stay together
        return gens

    def _score(self, prompts: Sequence[Any], generations: list[Any]) -> list[Sample]:
        texts = self.tokenizer.batch_decode([g.response_ids for g in generations], skip_special_tokens=True)
        samples = []
        for index, (gen, text) in enumerate(zip(generations, texts)):
            reward = float(self.task.reward(prompts[gen.prompt_index], text))
            samples.append(
                Sample(
                    prompt_ids=gen.prompt_ids,
                    response_ids=gen.response_ids,
                    reward=reward,
                    weight_version=gen.weight_version,
                    index=index,
                )
            )
        return samples

    def _stage_calls(self, shards: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        calls = [rank.stage.remote(i, shards[i]) for i, rank in enumerate(self.actors.policy)]
        calls += [self._critic_for(i).stage.remote(i, shards[i]) for i in range(len(shards))]
        calls += [self._reference_for(i).stage.remote(i, shards[i]) for i in range(len(shards))]
        return calls

    def _critic_for(self, shard: int):
        return self.actors.critic[shard % len(self.actors.critic)]

    def _reference_for(self, shard: int):
        return self.actors.reference[shard % len(self.actors.reference)]

    def _shards_of_critic(self, critic: int, num_shards: int) -> list[int]:
        return [i for i in range(num_shards) if i % len(self.actors.critic) == critic]

    def _get(self, refs: list[ray.ObjectRef], what: str, engine_call: bool = False) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.settings.step_timeout_s)
        except ray.exceptions.RayActorError as e:
            kind = "a vLLM engine" if engine_call else "a trainer or engine process"
            raise EngineDiedError(f"{kind} died while {what}: {e}") from e
        except ray.exceptions.GetTimeoutError as e:
            raise EngineDiedError(f"no answer within {self.settings.step_timeout_s:.0f}s while {what}") from e

    def _metrics(self, step, samples, handover, exp_stats, policy_stats, critic_stats, report, timings) -> dict[str, Any]:
        rewards = [s.reward for s in samples]
        response_tokens = sum(len(s.response_ids) for s in samples)

        def mean(rows: list[dict[str, float]], key: str) -> float:
            return sum(r[key] for r in rows) / max(len(rows), 1)

        metrics: dict[str, Any] = {
            "step": step,
            "weight_version": self.version,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/max": max(rewards),
            "reward/solved_frac": sum(r >= 1.0 for r in rewards) / len(rewards),
            "kl": mean(exp_stats, "kl"),
            "values/mean": mean(exp_stats, "values_mean"),
            "loss/policy": mean(policy_stats, "policy_loss"),
            "loss/value": mean(critic_stats, "value_loss"),
            "policy/clipfrac": mean(policy_stats, "clipfrac"),
            "policy/approx_kl": mean(policy_stats, "approx_kl"),
            "critic/vf_clipfrac": mean(critic_stats, "vf_clipfrac"),
            "response/mean_len": response_tokens / len(samples),
            "transfer/wire_bytes": handover.wire_bytes,
            "transfer/padded_tokens": handover.padded_tokens,
            "transfer/real_tokens": handover.real_tokens,
            "sync/bytes_per_engine": report.bytes_per_engine,
            "sync/gb_per_s": report.gb_per_s,
            "perf/tokens_per_s": (handover.real_tokens) / max(timings["step"], 1e-9),
            "perf/gen_tokens_per_s": response_tokens / max(timings["generate"], 1e-9),
        }
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        return metrics
