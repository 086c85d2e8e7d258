"""The training loop, readable top to bottom: rollout (generate, score, hand over) -> experience ->
train -> sync, for every algorithm (`algo`): the loop asks it what it needs (a critic, a reference,
dynamic sampling) and where its math runs, never which one it is.

The rollout's data path is the `transfer` strategy's business (`RolloutTransfer.deliver`): with
`micro_batched` and `packed` the engines score and hand experience to the trainers themselves and
the driver holds only prompts, lengths and rewards; `padded` is the gather-on-the-driver baseline.
After that, experience tensors move between actors as Ray object references.

When the rollout is generated relative to the weights is the `pipeline`'s business
(`rlhf_orch.orchestration.pipeline`): right before the hand-over with the newest weights (`sync`),
or during the previous step's training, one version behind (`one_step_off`). Two versions count:
`trained` (updates the trainers made) and `version` (what the engines hold: the engines' one owner,
`rlhf_orch.orchestration.fleet.EngineFleet`, which also pushes weights and replaces lost engines).
DAPO's rounds are `rlhf_orch.orchestration.dynamic_sampling`'s; a sample's reward is combined by
`rlhf_orch.reward.combine.sample_reward`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import KW_ONLY, dataclass
from typing import Any, Sequence

import ray

import torch

from rlhf_orch.algo.advantages import dynamic_sampling_keep
from rlhf_orch.algo.estimators import Algorithm
from rlhf_orch.logging.rollout_dump import RolloutDump
from rlhf_orch.orchestration.actors import RoleActors, ranks_named
from rlhf_orch.orchestration import dynamic_sampling
from rlhf_orch.orchestration.dynamic_sampling import GroupFilter
from rlhf_orch.orchestration.fleet import EngineFleet, TrainerVersion, rank_per_shard
from rlhf_orch.orchestration.waits import ActorWaits
from rlhf_orch.orchestration.errors import (  # noqa: F401 - raised here, and imported from here by callers
    ActorDiedError,
    ActorTimeoutError,
    EngineDiedError,
    EngineRestartBudgetError,
    StepFailedError,
)
from rlhf_orch.orchestration.checkpoint import engine_seed
from rlhf_orch.liveness import deferred
from rlhf_orch.orchestration.pipeline import RolloutPipeline, SyncPipeline
from rlhf_orch.reward.combine import sample_reward
from rlhf_orch.reward.scoring import RewardSetup
from rlhf_orch.sync.base import WeightSync
from rlhf_orch.trainer.metrics import trainer_metrics
from rlhf_orch.transfer.base import Delivery, HeldRollout, RolloutRequest, RolloutTransfer, Route
from rlhf_orch.transfer.rollout_meta import RolloutMeta
from rlhf_orch.transfer.plan import group_ids, trajectory_of


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
    # (keyword-only and required: the values come from the config's declarations, defaults and all)
    _: KW_ONLY
    max_seq_len: int  # prompt_max_len + response_max_len (0: longest prompt + response_max_len)
    max_engine_restarts: int  # engines replaced per invocation at most (fault.max_engine_restarts)
    engine_tp: int  # the placement plan's engine tensor-parallel size
    engines_sleep: bool  # engine.sleep_level > 0: idle engines release their GPU memory
    min_response_len: int  # algo.min_response_len
    train_batch_size: int  # algo.train_batch_size: sequences per optimizer step (0: no floor on micro-batches)
    # algo.tis_cap or algo.decoupled_is_cap set: the trainers weigh tokens by the engine's probability
    corrects_engine_sampling: bool


# Quantities that must stay finite; a NaN or inf in any of them stops the run (`non_finite`).
GUARDED_METRICS = (
    "reward/mean",
    "advantages/abs_max",
    "kl",
    "values/mean",
    "loss/policy",
    "loss/kl",
    "loss/value",
    "policy/grad_norm",
    "critic/grad_norm",
)


def sample_values_by_index(
    algo: Algorithm, meta: RolloutMeta, samples_per_prompt: int, response_max_len: int
) -> tuple[dict[int, float], dict[str, float]]:
    """The algorithm's per-sample value (`sample_values`) of every sequence, by index. Computed
    over trajectories: a trajectory's further sequences (env=agent) would otherwise weigh it
    several times in its group's mean and spread; each takes its trajectory's value. A masked
    trajectory (`env.mask_failed` / `env.mask_truncated`: it trains nothing) is left out of its
    group's statistics and gets 0, as veRL and SkyRL leave such samples out: an infrastructure
    failure's score would otherwise move its siblings' baseline."""
    trajectories = meta.trajectories_only()
    counted = trajectories.select([r for r, masked in enumerate(trajectories.masked) if not masked])
    of_trajectory = dict.fromkeys(trajectories.indices, 0.0)
    stats: dict[str, float] = {}
    if counted.indices:
        scores = torch.tensor(counted.rewards, dtype=torch.float32)
        groups = torch.tensor(group_ids(counted.indices, samples_per_prompt), dtype=torch.long)
        # the policy's own tokens (a multi-turn response's observations do not count towards overlong)
        lengths = torch.tensor(counted.model_token_lens, dtype=torch.long)
        values, stats = algo.sample_values(scores, groups, lengths, response_max_len)
        of_trajectory.update(zip(counted.indices, values.tolist()))
    return {i: of_trajectory[trajectory_of(i)] for i in meta.indices}, stats


def non_finite(metrics: dict[str, Any]) -> list[str]:
    """The guarded metrics of a step that are NaN or infinite ("key=value")."""
    return [f"{k}={metrics[k]}" for k in GUARDED_METRICS if k in metrics and not math.isfinite(metrics[k])]


def _fleet_attr(name: str, doc: str) -> property:
    """A field of the loop's engine fleet, read and set through the loop (the pipeline, the run
    record and resume ask the loop)."""
    return property(
        lambda self: getattr(self.fleet, name), lambda self, value: setattr(self.fleet, name, value), doc=doc
    )


def _trainers_attr() -> property:
    def set_trained(self, value: int) -> None:
        self.trainers.trained = value

    return property(
        lambda self: self.trainers.trained,
        set_trained,
        doc="updates the trainers made (= the version of their weights)",
    )


class TrainLoop:
    def __init__(
        self,
        actors: RoleActors,
        task: Any,
        tokenizer: Any,
        transfer: RolloutTransfer,
        sync: WeightSync,
        algo: Algorithm,
        settings: LoopSettings,
        reward: RewardSetup,
        pipeline: RolloutPipeline | None = None,
        env: Any = None,
        rollout_dump: RolloutDump | None = None,
    ):
        self.actors = actors
        # Multi-turn rollouts: the `env` option the engines drive trajectories with (None or a
        # single-turn option: one response per sample).
        self.env = env if getattr(env, "multi_turn", False) else None
        self.reward = reward
        self.task = task
        self.tokenizer = tokenizer
        self.transfer = transfer
        self.algo = algo
        self.settings = settings
        self.pipeline = pipeline if pipeline is not None else SyncPipeline()
        self.first_step = 1  # the first step this process runs (resume: the one after the checkpoint)
        self.trainers = TrainerVersion()  # the version the trainers hold, and the lock held while they update
        # The engines' one owner: their handles, the weights they hold, pushes and replacements.
        # Every wait on the run's actors: fault.step_timeout_s, or their progress; one line per failure.
        self._get = ActorWaits(settings.step_timeout_s).get
        self.fleet = EngineFleet(actors, sync, self.pipeline, transfer, settings, self.trainers, self._get)
        self.norm_len = algo.norm_len(settings.response_max_len)
        self.rollout_dump = rollout_dump  # logger.rollouts: what the model wrote, for people
        # Each step's prompt objects by prompt index (the rollout dump's data sources); a list the
        # dynamic sampling extends in place. Kept for the steps in flight only.
        self._prompts_of_step: dict[int, list[Any]] = {}
        self._drawing = (
            threading.Lock()
        )  # a rollout thread draws a step's prompts (one_step_off) while the main thread asks
        self._data_before: dict[
            int, dict[str, Any]
        ] = {}  # per step drawn, the sampler's position before (data_state_before)
        self.updating = False  # an update of the trainers is in progress (or failed half-way): see _update

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, Any]:
        algo = self.algo
        timings: dict[str, float] = {}
        t_step = time.perf_counter()

        # 1-3. Rollout: generate, score with the rule, and stage every data-parallel shard on the
        #      ranks that need it (how: the transfer strategy; when, relative to the weights: the
        #      pipeline -- now, or during the previous step's training).
        delivery = self.pipeline.rollout(self, step, timings)
        self._check_every_sample_once(delivery)
        self.pipeline.engines_idle(self)
        timings.update({k: v for k, v in delivery.timings.items() if k not in timings})
        num_shards = len(self.actors.policy)  # one experience shard per policy rank

        with self.trainers.training:  # an engine replaced meanwhile waits, then takes these weights
            t_train = time.perf_counter()
            # 3b. Reward model (reward=model): its ranks staged the same shards; only scores come back.
            self._model_scores(delivery, num_shards, timings)

            # 4. Experience. The algorithm turns the final scores into per-sample values on the
            #    driver (outcome advantages, group-centred scores, or the scores), the ranks get
            #    only floats; reference logprobs and critic values (object refs) feed the token
            #    targets there.
            t = time.perf_counter()
            values_by_index, algo_stats = self._sample_values(delivery)
            values_ref = ray.put(values_by_index)  # one float per sample; every rank picks its own
            frozen_lp = [  # the reference ranks' frozen models: {"ref": ..., "teacher": ...}
                r.logprobs.remote(i) if r else None
                for i, r in enumerate(rank_per_shard(self.actors.reference, num_shards))
            ]
            values = [
                c.values.remote(i) if c else None for i, c in enumerate(rank_per_shard(self.actors.critic, num_shards))
            ]
            made = [
                # (deferred: the rank starts at once and waits for them itself, answering `progress` meanwhile)
                rank.make_experience.options(num_returns=2).remote(
                    i, deferred(frozen_lp[i]), deferred(values[i]), algo, values_ref
                )
                for i, rank in enumerate(self.actors.policy)
            ]
            exp_stats = self._get(
                [m[0] for m in made],
                "computing experience",
                progress_of=ranks_named(self.actors, "policy", "reference", "critic"),
            )
            returns = [m[1] for m in made]
            timings["experience"] = time.perf_counter() - t

            # 5. Train the policy (and the critic, when there is one) concurrently. The rollout
            #    dump's sequences stay on the ranks through the update (its forward may be where
            #    the trainer's log-probs of them come from) and are read after it.
            t = time.perf_counter()
            wanted = self._dumped_indices(step, delivery)
            policy_calls = [
                rank.train.remote(i, algo, self.norm_len, wanted) for i, rank in enumerate(self.actors.policy)
            ]
            dumped = [rank.dumped_sequences.remote() for rank in self.actors.policy] if wanted else None
            critic_calls = [
                critic.train.remote({i: returns[i] for i in self._shards_of_critic(c, num_shards)})
                for c, critic in enumerate(self.actors.critic)
            ]
            policy_stats, critic_stats = self._update(policy_calls, critic_calls)
            t_end = time.perf_counter()
            timings["train"] = t_end - t
        overlap = self.pipeline.overlap_s(t_train, t_end)
        if overlap is not None:
            timings["overlap"] = overlap

        # 6. Sync (sync pipeline): the engines get the new weights and version now; one_step_off
        #    moves them after the rollout in flight finishes.
        self.pipeline.after_train(self, timings)
        t_done = time.perf_counter()
        timings["step"] = t_done - t_step
        idle = self.pipeline.engine_idle_s(t_step, t_done)
        if idle is not None:  # engines that generate across steps: the part of this step they had nothing to do
            timings["engine_idle"] = idle

        if dumped is not None:
            t = time.perf_counter()
            sequences = [
                seq
                for part in self._get(
                    dumped, "reading the rollout dump", progress_of=ranks_named(self.actors, "policy")
                )
                for seq in part
            ]
            self.rollout_dump.write(
                step, sequences, delivery.meta, self._prompts_of_step.get(step), self.settings.samples_per_prompt
            )
            timings["rollout_dump"] = time.perf_counter() - t
        # pop, not a sweep: under one_step_off the rollout thread adds the next step's entry meanwhile.
        self._prompts_of_step.pop(step, None)
        self._data_before.pop(step, None)

        metrics = self._metrics(step, delivery, exp_stats, policy_stats, critic_stats, timings)
        metrics.update(self.pipeline.metrics(delivery, self.trained))
        metrics.update(algo_stats)
        metrics.update(self.fleet.metrics(step))
        return metrics

    def _update(
        self, policy_calls: list[ray.ObjectRef], critic_calls: list[ray.ObjectRef]
    ) -> tuple[list[Any], list[Any]]:
        """Wait for the policy's and the critic's update of this step. Only once both returned do
        the trainers hold the next version (`trained`); a failure in between leaves `updating`
        set: the policy may have stepped its optimizer while the critic did not (or the other way),
        a state no checkpoint may be written from."""
        self.updating = (
            True  # (the calls are in flight: until both return, one role may have stepped and the other not)
        )
        training = ranks_named(
            self.actors, "policy", "critic"
        )  # (they train at once: each waits while the other moves)
        policy_stats = self._get(policy_calls, "training the policy", progress_of=training)
        critic_stats = self._get(critic_calls, "training the critic", progress_of=training)
        self.trainers.trained += 1
        self.updating = False
        return policy_stats, critic_stats

    def data_state_before(self, step: int) -> dict[str, Any]:
        """The data sampler's position before step `step`'s prompts were drawn (now, if they were
        not): what a checkpoint of step `step - 1` that does not carry the rollouts drawn ahead
        (one_step_off, async) records, so a resumed run draws them again instead of skipping them."""
        with self._drawing:
            return self._data_before[step] if step in self._data_before else self.task.state_dict()

    # ------------------------------------------------------------------ what the pipeline calls
    def rollout_request(self, step: int) -> RolloutRequest:
        """Step `step`'s prompts, after seeding every engine for that step: a resumed run or a
        replaced engine draws what an uninterrupted run would have."""
        s = self.settings
        route = self.route(step)
        route.on_engines(
            lambda e, engine: engine.reseed.remote(engine_seed(s.seed, step, e)),
            range(len(route.engines)),
            "seeding the engines",
        )
        with self._drawing:  # (the position and the draw, as one: data_state_before may ask meanwhile)
            self._data_before[step] = self.task.state_dict()
            prompts = self.task.sample_prompts(s.rollout_batch_size)
        request = self._rollout_request(prompts)
        self._prompts_of_step[step] = request.prompts
        return request

    def _dumped_indices(self, step: int, delivery: Delivery) -> list[int]:
        """The sample indices the rollout dump shows this step (none: no dump this step)."""
        if self.rollout_dump is None or not self.rollout_dump.dumps(step):
            return []
        return self.rollout_dump.pick(delivery.meta.indices)

    def generate(self, step: int) -> HeldRollout:
        """Step `step`'s rollout generated and scored, held where the transfer holds it."""
        held = self.make_rollout(self.rollout_request(step), self.route(step))
        held.step = step
        return held

    def make_rollout(self, request: RolloutRequest, route: Route) -> HeldRollout:
        """`request` generated and held, in as many rounds as the algorithm's dynamic sampling takes."""
        return dynamic_sampling.generate(self.transfer, request, route, self._group_filter())

    def _check_every_sample_once(self, delivery: Delivery) -> None:
        s = self.settings
        indices = delivery.meta.trajectories_only().indices
        want = s.rollout_batch_size * s.samples_per_prompt
        if len(indices) != want or len(set(indices)) != len(indices):
            raise StepFailedError(
                f"the rollout delivered {len(indices)} samples ({len(indices) - len(set(indices))} duplicated), expected {want} distinct"
            )
        every = delivery.meta.indices
        strays = {trajectory_of(i) for i in every} - set(indices)
        if len(set(every)) != len(every) or strays:
            raise StepFailedError(
                f"the rollout delivered {len(every) - len(set(every))} duplicated sequences and further sequences "
                f"of {len(strays)} trajectories it did not deliver"
            )

    def _sample_values(self, delivery: Delivery) -> tuple[dict[int, float], dict[str, float]]:
        s = self.settings
        return sample_values_by_index(self.algo, delivery.meta, s.samples_per_prompt, s.response_max_len)

    # ------------------------------------------------------------------ pieces
    def _model_scores(self, delivery: Delivery, num_shards: int, timings: dict[str, float]) -> None:
        """Score every shard on the reward-model ranks; fold the scores into the delivery's rewards
        (without a reward model the scores the engines attached stand)."""
        if not self.reward.has_model:
            return
        t = time.perf_counter()
        parts = self._get(
            [rm.score.remote(i) for i, rm in enumerate(rank_per_shard(self.actors.reward, num_shards))],
            "scoring with the reward model",
            progress_of=ranks_named(self.actors, "reward"),
        )
        model_score = {i: v for indices, values in parts for i, v in zip(indices, values)}
        meta = delivery.meta
        weight = self.reward.model.weight
        rule = [r if self.reward.rule is not None else 0.0 for r in meta.rewards]
        meta.model_rewards = [model_score[i] for i in meta.indices]
        meta.rule_rewards = rule if self.reward.rule is not None else None
        # (the engines' scores are weighted already: RuleScoring, an environment's combination)
        meta.rewards = [sample_reward(r, 1.0, model=m, model_weight=weight) for r, m in zip(rule, meta.model_rewards)]
        meta.share_trajectory_rewards()
        timings["reward_model"] = time.perf_counter() - t

    def _rollout_request(self, prompts: Sequence[Any]) -> RolloutRequest:
        s = self.settings
        tokenizer = self.tokenizer
        prompt_ids = [list(p.prompt_ids) for p in prompts]
        return RolloutRequest(
            prompts=list(prompts),
            prompt_ids=prompt_ids,
            samples_per_prompt=s.samples_per_prompt,
            max_tokens=s.response_max_len,
            min_tokens=s.min_response_len,
            temperature=s.temperature,
            scorer=self.reward.rule,
            num_shards=len(self.actors.policy),
            micro_batch_size=s.micro_batch_size,
            train_batch_size=s.train_batch_size,
            corrects_engine_sampling=s.corrects_engine_sampling,
            pad_id=tokenizer.pad_token_id,
            max_seq_len=s.max_seq_len or max(map(len, prompt_ids)) + s.response_max_len,
            decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
            env=self.env,
        )

    def _group_filter(self) -> GroupFilter | None:
        """DAPO's dynamic sampling: which groups to keep, and where more prompts come from."""
        if not self.algo.uses_dynamic_sampling:
            return None
        return GroupFilter(
            keep=self.algo.keep_groups, more_prompts=self.task.sample_prompts, max_rounds=self.algo.max_gen_batches
        )

    def _shards_of_critic(self, critic: int, num_shards: int) -> list[int]:
        return [i for i in range(num_shards) if i % len(self.actors.critic) == critic]

    def _metrics(self, step, delivery: Delivery, exp_stats, policy_stats, critic_stats, timings) -> dict[str, Any]:
        trajectories = delivery.meta.trajectories_only()
        rewards = trajectories.rewards
        report = self.last_sync
        response_tokens = sum(delivery.meta.response_lens)
        sequences = len(delivery.meta.indices)

        metrics: dict[str, Any] = {
            "step": step,
            "weight_version": self.version,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/max": max(rewards),
            "reward/solved_frac": sum(r >= 1.0 for r in rewards) / len(rewards),
            "rollout/samples": len(rewards),
            "reward/errors": delivery.meta.reward_errors,
            "reward/timeouts": delivery.meta.reward_timeouts,
            "rollout/sequences": sequences,
            "response/mean_len": response_tokens / sequences,
            "response/max_len": max(delivery.meta.response_lens),
            "transfer/wire_bytes": delivery.wire_bytes,
            "transfer/padded_tokens": delivery.wire_tokens,
            "transfer/real_tokens": delivery.real_tokens,
            "perf/tokens_per_s": delivery.real_tokens / max(timings["step"], 1e-9),
            "perf/gen_tokens_per_s": response_tokens / max(timings["generate"], 1e-9),
        }
        if report is not None:
            metrics["sync/bytes_per_engine"] = report.bytes_per_engine
            metrics["sync/gb_per_s"] = report.gb_per_s
        # How old the rollout is: the trainers' version when training on it minus the version of
        # the weights that drew each sample (0 on-policy; one_step_off: 1 after the first step).
        staleness = [self.trained - 1 - v for v in delivery.meta.weight_versions]
        if staleness:
            metrics["rollout/staleness_max"] = max(staleness)
            metrics["rollout/staleness_mean"] = sum(staleness) / len(staleness)
        metrics.update(trainer_metrics(exp_stats, policy_stats, critic_stats, self.algo.needs_reference))
        if self.settings.samples_per_prompt > 1:
            # Groups whose samples all scored the same: no gradient under a group-relative
            # advantage (DAPO's dynamic sampling drops them before training).
            groups = torch.tensor(group_ids(trajectories.indices, self.settings.samples_per_prompt), dtype=torch.long)
            informative = dynamic_sampling_keep(torch.tensor(rewards, dtype=torch.float32), groups)
            metrics["rollout/uniform_groups"] = len(set(groups[~informative].tolist()))
        if delivery.dropped_groups is not None:
            metrics["sampling/dropped_groups"] = delivery.dropped_groups
            metrics["sampling/rounds"] = delivery.rounds
        env_stats, env_metrics = delivery.meta.env_stats_total(), delivery.meta.env_metrics_list()
        if env_stats and self.env is not None:
            metrics.update(self.env.metrics(env_stats))
            for line in self.env.notices(metrics):
                print(line, flush=True)
        if env_metrics and self.env is not None:
            metrics.update(self.env.aggregate(env_metrics))
        if delivery.meta.model_rewards is not None:
            metrics["reward/model"] = sum(trajectories.model_rewards) / len(rewards)
        if delivery.meta.rule_rewards is not None:
            metrics["reward/rule"] = sum(trajectories.rule_rewards) / len(rewards)
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        # Shares of the step: what the transfer and sync strategies cost relative to everything else.
        for phase in ("generate", "transfer", "experience", "train", "sync", "rollout_wait", "overlap"):
            if phase in timings:
                metrics[f"share/{phase}"] = timings[phase] / max(timings["step"], 1e-9)
        return metrics

    # ------------------------------------------------------------------ the engines (the fleet's)
    trained = _trainers_attr()
    version = _fleet_attr("version", "the weights the engines hold")
    restart_log = _fleet_attr("restart_log", "per step whose rollout lost an engine, an entry per replacement")
    engine_restarts_before = _fleet_attr("engine_restarts_before", "replacements made before this invocation")
    closing = _fleet_attr("closing", "the run is ending: engines that stop are not replaced")
    last_sync = _fleet_attr("last_sync", "the last push's report")

    @property
    def engine_restarts(self) -> int:
        return self.fleet.engine_restarts

    @property
    def engine_restarts_used(self) -> int:
        return self.fleet.engine_restarts_used

    def route(self, step: int | None = None) -> Route:
        return self.fleet.route(step)

    def sync_engines(self, timings: dict[str, float]) -> None:
        self.fleet.sync_engines(timings)

    def sleep_engines(self) -> None:
        self.fleet.sleep_engines()

    def hand_over(self, held: HeldRollout) -> Delivery:
        return self.fleet.hand_over(held)

    def export_held(self, held: HeldRollout) -> HeldRollout:
        return self.fleet.export_held(held)
