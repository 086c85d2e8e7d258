"""The PPO loop, readable top to bottom: rollout (generate, score, hand over) -> experience -> train -> sync.

The rollout's data path is the `transfer` strategy's business (`RolloutTransfer.deliver`): with
`micro_batched` and `packed` the engines score and hand experience to the trainers themselves and
the driver holds only prompts, lengths and rewards; `padded` is the gather-on-the-driver baseline.
After that, experience tensors move between actors as Ray object references.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from rlhf_orch.algo.experience import AdvantageSettings
from rlhf_orch.orchestration.actors import RoleActors
from rlhf_orch.sync.base import WeightSync
from rlhf_orch.transfer.base import Delivery, RolloutRequest, RolloutTransfer, Route


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
    max_seq_len: int = 0  # prompt_max_len + response_max_len (0: longest prompt + response_max_len)


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

        # 1-3. Rollout: generate, score with the rule, and stage every data-parallel shard on the
        #      policy, critic and reference ranks that need it (how: the transfer strategy).
        prompts = self.task.sample_prompts(s.rollout_batch_size, step)
        delivery = self.transfer.deliver(self._rollout_request(prompts), self._route())
        timings.update(delivery.timings)
        num_shards = len(self.actors.policy)  # one experience shard per policy rank

        # 4. Experience: reference logprobs and values (object refs), then old logprobs + GAE
        #    on the policy ranks, which pass the critic its returns.
        t = time.perf_counter()
        ref_lp = [self._reference_for(i).logprobs.remote(i) for i in range(num_shards)]
        values = [self._critic_for(i).values.remote(i) for i in range(num_shards)]
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
            critic.train.remote({i: returns[i] for i in self._shards_of_critic(c, num_shards)})
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

        return self._metrics(step, delivery, exp_stats, policy_stats, critic_stats, report, timings)

    # ------------------------------------------------------------------ pieces
    def _rollout_request(self, prompts: Sequence[Any]) -> RolloutRequest:
        s = self.settings
        tokenizer = self.tokenizer
        prompt_ids = [tokenizer(p.text).input_ids for p in prompts]
        return RolloutRequest(
            prompts=list(prompts),
            prompt_ids=prompt_ids,
            samples_per_prompt=s.samples_per_prompt,
            max_tokens=s.response_max_len,
            temperature=s.temperature,
            scorer=self.task.reward,
            num_shards=len(self.actors.policy),
            micro_batch_size=s.micro_batch_size,
            pad_id=tokenizer.pad_token_id,
            max_seq_len=s.max_seq_len or max(map(len, prompt_ids)) + s.response_max_len,
            decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
        )

    def _route(self) -> Route:
        """Per shard, every actor that stages it: its policy rank, critic and reference."""
        consumers = [
            [rank, self._critic_for(i), self._reference_for(i)] for i, rank in enumerate(self.actors.policy)
        ]
        return Route(engines=list(self.actors.engines), consumers=consumers, get=self._get)

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

    def _metrics(self, step, delivery: Delivery, exp_stats, policy_stats, critic_stats, report, timings) -> dict[str, Any]:
        rewards = delivery.meta.rewards
        response_tokens = sum(delivery.meta.response_lens)

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
            "response/mean_len": response_tokens / len(rewards),
            "response/max_len": max(delivery.meta.response_lens),
            "transfer/wire_bytes": delivery.wire_bytes,
            "transfer/padded_tokens": delivery.wire_tokens,
            "transfer/real_tokens": delivery.real_tokens,
            "sync/bytes_per_engine": report.bytes_per_engine,
            "sync/gb_per_s": report.gb_per_s,
            "perf/tokens_per_s": delivery.real_tokens / max(timings["step"], 1e-9),
            "perf/gen_tokens_per_s": response_tokens / max(timings["generate"], 1e-9),
        }
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        return metrics
