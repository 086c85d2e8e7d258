"""Every combination of strategies computes the algorithm it names: the trainer against the oracle.

For each `algo` option x each `algo.loss_agg` x each `transfer` option x 1 and 2 policy ranks x two
micro-batch / `train_batch_size` cuts, `ppo_epochs` 2 with plain SGD (and 1 and 2 with Adam on a
rotation of transfer x ranks, `_settings`), one update through the real system -- the transfer strategy's own layout, real `PolicyWorker` / `CriticWorker` Ray actors
running DeepSpeed ZeRO-2 over gloo (one rank: stage 0, as a run runs it, `zero_stage_to_run`) -- on
a fixed rollout must give the weights and the logged
metrics of `rlhf_orch.algo.oracle.reference_update`, which is the same update written plainly
(no micro-batches, no ranks, no packing). The engines add nothing here (the rollout is fixed), so
none is started: one Ray session, six trainer actors, the tiny model, each actor rebuilt from the
checkpoint for each case (~20 ms).

The rollout has an empty response, a group of equal scores and lengths from 1 to 9; every case
runs with an entropy bonus, truncated IS against engine log-probs, and the dual clip, so every
term of the loss is live. AReaL's decoupled PPO weights (`algo.decoupled_is_cap`, which replaces
truncated IS: the two are refused together) get one loss aggregation per algo, rotated, with every
transfer x ranks x cut x epochs as above; its cap 5 (AReaL's) drops some of the rollout's action
tokens and keeps most (on the tiny model built here: 9 of 64, the nearest weights 4.7 and 5.4, far
from float noise). Which sequences share an optimizer step is the trainer's sampling
decision, read back from the ranks and given to the oracle; the test checks it is a partition of
the rollout per epoch.

Tolerances (float32 on CPU; the two sides differ in summation order and attention kernels):
SGD -- every weight within 2e-6 + 1e-3 x the largest update (a scale error of the loss moves
weights by whole multiples of the update). Adam -- it divides by sqrt(v), so a weight whose
gradient is ~0 turns float noise into a step of up to lr (either sign): 99.9 % of the weights
within 2e-6 + 2e-3 x the largest update, none off by more than twice the largest update. Metrics within 1e-4 relative (gradient
norms 1e-3). Measured: SGD weights agree to ~1e-7, Adam's 99.9th percentile to ~2e-7.
Adam's lr is 1e-4: its first steps move every weight by ~lr, and at 5e-4 four steps took the
tiny model's approx_kl to 0.13, where ratios cross the clip boundaries and float noise changes
which tokens clip (one case then failed on one build of the tiny model: approx_kl off by 5e-4
relative, 0.2 % of weights off); at 1e-4 the same case agrees to 3e-7 and still clips 3 % of tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import random
from pathlib import Path

import pytest
import ray
import torch
from hydra.utils import instantiate

from rlhf_orch.algo.losses import LOSS_AGGREGATIONS
from rlhf_orch.algo.oracle import Optimization, Rollout, reference_update
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.orchestration.loop import sample_values_by_index
from rlhf_orch.trainer.forward import load_critic, load_policy
from rlhf_orch.trainer.lora import AdapterWeights, apply_lora
from rlhf_orch.trainer.metrics import trainer_metrics
from rlhf_orch.trainer.critic import CriticWorker
from rlhf_orch.trainer.deepspeed_config import zero_stage_to_run
from rlhf_orch.trainer.policy import PolicyWorker
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.transfer.batch import LOSS_MASK, SAMPLING_TEMPERATURE, TURN_REWARDS, Sample
from rlhf_orch.transfer.engine_side import rollout_meta
from tests.conftest import compose_config, start_trainer_ranks

pytestmark = pytest.mark.integration

ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}
ALGORITHMS = ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "on_policy_distill"]
TRANSFERS = ["padded", "micro_batched", "packed"]
SAMPLES_PER_PROMPT = 4
MAX_RESPONSE_LEN = 10
# (micro_batch_size, train_batch_size, packed token budget): one optimizer step per epoch in equal
# micro-batches; then two steps per epoch over ragged micro-batches (packed: cut by tokens).
CUTS = {"one_step": (4, 16, 0), "two_steps": (3, 8, 24)}
LR = {"sgd": 0.05, "adamw": 1e-4}
SEED = 3
# model.lora: adapters on every linear layer; alpha / rank = 4 as the default.
LORA = LoraSettings(rank=4, alpha=16, target_modules="all-linear")


HOLED = (2, 5, 11, 14)  # samples whose responses hold an observation (loss mask 0 in the middle)
MIXED_TEMPERATURE = (1, 5, 12)  # samples whose tokens were sampled at their own temperatures


def _rollout() -> list[Sample]:
    rng = random.Random(5)
    samples = []
    # The samples of a prompt share it, as the engines return them: packed micro-batches then hold
    # each prompt once (trainer.share_prompts, on in these specs).
    prompts = [[1] + [rng.randint(29, 38) for _ in range(rng.randint(2, 6))] for _ in range(16 // SAMPLES_PER_PROMPT)]
    for i in range(16):
        prompt = list(prompts[i // SAMPLES_PER_PROMPT])
        length = 0 if i == 9 else rng.randint(1, 9)
        response = [rng.randint(29, 38) for _ in range(length)]
        samples.append(
            Sample(
                prompt,
                response,
                round(rng.random(), 2),
                engine_logprobs=[rng.uniform(-4.5, -2.0) for _ in response],
                index=i,
                fields={"ref": [rng.uniform(-4.0, -2.5) for _ in response]},
            )
        )
    for s in samples[4:8]:  # a group of equal scores: no signal (but per-turn rewards: sample 5's turns differ)
        s.reward = 0.5
    # Multi-turn trajectories (env): tokens of a tool's or user's reply inside a response are
    # context, not actions -- a loss mask with holes, folded into the trainer's action mask.
    for s in samples:
        n = len(s.response_ids)
        mask = [1.0] * n
        if s.index in HOLED and n >= 4:
            mask[1 : n - 2] = [0.0] * (n - 3)
        s.fields[LOSS_MASK] = mask
        # env.reward=per_turn: each turn's reward on its last token (a holed response's first turn is
        # its token 0); sample 2 keeps 0.1 of its score off the turns (a reward group's share), which
        # goes on the last token. Read by PPO and REINFORCE++ only (the others refuse per_turn).
        placed = [0.0] * n
        if n:
            first = round(rng.uniform(-0.5, 0.5), 2) if s.index in HOLED and n >= 4 else 0.0
            placed[0] += first
            placed[-1] += s.reward - first - (0.1 if s.index == 2 else 0.0)
        if s.index == 5 and n >= 4:  # a value on an observation token (loss mask 0): it counts on the last token
            placed[1] = 0.2
        s.fields[TURN_REWARDS] = placed
        # env=agent with calls at their own temperatures (env.sampling=call): a call at 0.7, one at
        # 1.3 after it, the rest at the run's (0); each token is scored at its own.
        temperatures = [0.0] * n
        if s.index in MIXED_TEMPERATURE and n >= 3:
            temperatures[: n // 2] = [0.7] * (n // 2)
            temperatures[n // 2 :] = [1.3] * (n - n // 2)
        s.fields[SAMPLING_TEMPERATURE] = temperatures
    # A teacher's log-probs of every response token (the teacher term: algo.distill_coef), drawn
    # apart so the rollout above stays what it was; some above the tiny model's, some below.
    teacher_rng = random.Random(7)
    for s in samples:
        s.fields["teacher"] = [teacher_rng.uniform(-4.5, -1.5) for _ in s.response_ids]
    return samples


SAMPLES = _rollout()


# The correction for the engine's sampling each case runs with: truncated IS, or AReaL's decoupled
# PPO weights (tokens above the cap dropped).
IS_CORRECTIONS = {"tis": ["algo.tis_cap=1.5"], "decoupled": ["algo.decoupled_is_cap=5"]}


@functools.lru_cache(maxsize=None)
def _composed_algo(name: str, correction: str):
    overrides = [
        f"algo={name}",
        f"algo.samples_per_prompt={SAMPLES_PER_PROMPT}",
        "algo.entropy_coef=0.01",
        *IS_CORRECTIONS[correction],
        "algo.clip_ratio_c=1.05",
        "algo.kl_coef=0.05",
        f"algo.loss_agg_norm_len={MAX_RESPONSE_LEN}",
    ]
    if name == "dapo":
        overrides.append("algo.overlong_buffer=4")
    return instantiate(compose_config(overrides).algo)


def _algo(
    name: str,
    agg: str,
    epochs: int,
    correction: str,
    kl_placement: str | None = None,
    distill_coef: float | None = None,
):
    algo = dataclasses.replace(_composed_algo(name, correction), loss_agg=agg, ppo_epochs=epochs)
    algo = dataclasses.replace(algo, kl_placement=kl_placement) if kl_placement else algo
    return dataclasses.replace(algo, distill_coef=distill_coef) if distill_coef is not None else algo


@functools.lru_cache(maxsize=None)
def _transfer(name: str, token_budget: int):
    overrides = [f"transfer={name}"] + ([f"transfer.token_budget={token_budget}"] if name == "packed" else [])
    return instantiate(compose_config(overrides).transfer)


def _spec(
    model_path: str, ranks: int, cut: str, optimizer: str, epochs: int, critic: bool, lora: LoraSettings | None = None
) -> TrainerSpec:
    micro, train_batch, _ = CUTS[cut]
    return TrainerSpec(
        model_path=model_path,
        dtype="float32",
        zero_stage=zero_stage_to_run(2, ranks, offload_optimizer=False),  # one rank: stage 0, as a run
        micro_batch_size=micro,
        train_batch_size=train_batch,
        data_parallel_size=ranks,
        pad_id=0,
        temperature=1.0,
        lr=LR[optimizer] * (4 if critic else 1),
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=epochs,
        seed=SEED,
        torch_threads=1,
        optimizer=optimizer,
        reference_memory="full",
        lora=None if critic else lora,
        share_prompts=True,  # the run's default: packed micro-batches run a shared prompt once (padded ones cannot)
    )


def _group(cls, model_path: str, ranks: int) -> list:
    return start_trainer_ranks(cls, _spec(model_path, ranks, "one_step", "sgd", 1, False), ranks, ENV)


@pytest.fixture(scope="module")
def actors(tiny_model_path):
    ray.init(address="local", num_cpus=6, num_gpus=0, include_dashboard=False, runtime_env=ENV, log_to_driver=False)
    groups = {
        (role, n): _group(cls, tiny_model_path, n)
        for role, cls in (("policy", PolicyWorker), ("critic", CriticWorker))
        for n in (1, 2)
    }
    yield groups
    ray.shutdown()


def _submit_update(
    actors, model_path, algo, transfer_name, ranks, cut, optimizer, train_critic: bool, lora: LoraSettings | None = None
) -> dict:
    """Submit one update through the transfer layout and the trainer actors; returns the pending
    results. Nothing waits here: an actor runs its calls in the order submitted, so the cases of
    a test queue up behind each other and the driver checks one while the actors run the next."""
    micro, _, budget = CUTS[cut]
    shards = _transfer(transfer_name, budget).layout(SAMPLES, ranks, micro, 0)
    policy, critic = actors[("policy", ranks)], actors[("critic", ranks)] if algo.needs_critic else []
    for w in policy:
        w.build.remote(_spec(model_path, ranks, cut, optimizer, algo.ppo_epochs, False, lora))
    for w in critic:
        w.build.remote(_spec(model_path, ranks, cut, optimizer, algo.ppo_epochs, True))
    # the driver's own path: the rollout's metadata as an engine reports it (DAPO's overlong
    # penalty counts the policy's tokens: the holes of a multi-turn response do not count)
    by_index, _ = sample_values_by_index(algo, rollout_meta(SAMPLES), SAMPLES_PER_PROMPT, MAX_RESPONSE_LEN)
    made = []
    for rank, shard in enumerate(shards):
        policy[rank].stage.remote(rank, shard)
        # what the reference ranks return: the KL reference's and the teacher's log-probs (given here)
        frozen = {key: [mb.fields[key] for mb in shard] for key in algo.frozen_models}
        old_values = None
        if critic:
            critic[rank].stage.remote(rank, shard)
            old_values = critic[rank].values.remote(rank)
        made.append(
            policy[rank].make_experience.options(num_returns=2).remote(rank, frozen or None, old_values, algo, by_index)
        )
    return {
        "exp": [m[0] for m in made],
        # (every sequence kept for the rollout dump: what it shows is checked against the oracle too)
        "policy_stats": [
            w.train.remote(rank, algo, MAX_RESPONSE_LEN, [s.index for s in SAMPLES]) for rank, w in enumerate(policy)
        ],
        "dumped": [w.dumped_sequences.remote() for w in policy],
        # (model.lora: the adapters, the only weights that train)
        "policy": (policy[0].adapter_weights if lora else policy[0].full_weights).remote(),
        "policy_rest": [
            (w.adapter_weights if lora else w.full_weights).remote() for w in policy[1:]
        ],  # every rank calls (ZeRO-3 gathers)
        "policy_steps": [w.step_members.remote() for w in policy],
        **_submit_critic_update(critic if train_critic else [], made),
    }


def _submit_critic_update(critic: list, made: list) -> dict:
    return {
        "critic_stats": [c.train.remote({rank: made[rank][1]}) for rank, c in enumerate(critic)],
        "critic": critic[0].full_weights.remote() if critic else None,
        "critic_rest": [w.full_weights.remote() for w in critic[1:]],
        "critic_steps": [c.step_members.remote() for c in critic],
    }


def _collect(pending: dict, algo) -> dict:
    """What the run would log, the updated weights, and which sequences shared each step."""
    exp_stats, policy_stats, critic_stats = (ray.get(pending[k]) for k in ("exp", "policy_stats", "critic_stats"))
    ray.get(pending["policy_rest"] + pending["critic_rest"])
    metrics = trainer_metrics(exp_stats, policy_stats, critic_stats, algo.needs_reference)
    # (which forward gave pi_old: no quantity of the algorithm, so none the oracle logs)
    logged_from_update = metrics.pop("trainer/old_logprobs_from_update")
    return {
        "metrics": metrics,
        # (every rank decides alike: from the plan of all ranks' sequences)
        "old_from_update": {bool(e["old_logprobs_from_update"]) for e in exp_stats} | {bool(logged_from_update)},
        "policy": ray.get(pending["policy"]),
        "dumped": [seq for part in ray.get(pending["dumped"]) for seq in part],
        "critic": ray.get(pending["critic"]) if pending["critic"] is not None else None,
        "policy_steps": _steps(ray.get(pending["policy_steps"])),
        "critic_steps": _steps(ray.get(pending["critic_steps"])) if pending["critic_steps"] else None,
    }


def _steps(per_rank: list[list[tuple[int, ...]]]) -> list[list[int]]:
    """Per optimizer step, the sample indices of every rank (ranks step together)."""
    assert len({len(r) for r in per_rank}) == 1, "ranks disagree on the number of optimizer steps"
    return [sorted(i for rank in per_rank for i in rank[k]) for k in range(len(per_rank[0]))]


@functools.lru_cache(maxsize=None)
def _initial_model(model_path: str, role: str) -> torch.nn.Module:
    return (load_policy if role == "policy" else load_critic)(model_path, "float32", "cpu")


def _oracle(model_path, algo, optimizer, policy_steps, critic_steps, lora: LoraSettings | None = None):
    rollout = Rollout(
        prompts=[list(s.prompt_ids) for s in SAMPLES],
        responses=[list(s.response_ids) for s in SAMPLES],
        scores=[s.reward for s in SAMPLES],
        group_ids=[s.index // SAMPLES_PER_PROMPT for s in SAMPLES],
        ref_logprobs=[list(s.fields["ref"]) for s in SAMPLES],
        teacher_logprobs=[list(s.fields["teacher"]) for s in SAMPLES],
        engine_logprobs=[list(s.engine_logprobs) for s in SAMPLES],
        loss_masks=[[int(m) for m in s.fields[LOSS_MASK]] for s in SAMPLES],
        turn_rewards=[list(s.fields[TURN_REWARDS]) for s in SAMPLES],
        temperatures=[list(s.fields[SAMPLING_TEMPERATURE]) for s in SAMPLES],
    )
    opt = Optimization(
        actor_lr=LR[optimizer],
        critic_lr=LR[optimizer] * 4,
        optimizer=optimizer,
        weight_decay=0.0,
        grad_clip=1.0,
        temperature=1.0,
        norm_len=MAX_RESPONSE_LEN,
    )
    policy = copy.deepcopy(_initial_model(model_path, "policy")).train()
    if lora is not None:  # the same adapters the trainer starts from (A drawn from the spec's seed)
        policy = apply_lora(policy, lora, SEED)
    critic = copy.deepcopy(_initial_model(model_path, "critic")).train() if algo.needs_critic else None
    critic_steps = critic_steps or []  # [] = the critic gives the old values and is not trained
    result = reference_update(
        algo,
        rollout,
        policy,
        opt,
        policy_steps,
        critic,
        critic_steps,
        value_clip_eps=0.2,
        max_response_len=MAX_RESPONSE_LEN,
    )
    return result


def _assert_weights_close(
    system: dict[str, torch.Tensor],
    oracle: torch.nn.Module,
    initial: dict[str, torch.Tensor],
    optimizer: str,
    what: str,
    adapters: bool = False,
):
    expected = _adapters(oracle) if adapters else dict(oracle.named_parameters())
    assert set(system) == set(expected), what
    diff = torch.cat([(system[n] - expected[n].detach()).flatten().abs() for n in sorted(system)])
    update = torch.cat([(expected[n].detach() - initial[n]).flatten().abs() for n in sorted(system)])
    assert float(update.max()) > 5e-5, f"{what}: the update barely moved the weights"  # Adam's first step: ~lr
    if optimizer == "sgd":
        tol = 2e-6 + 1e-3 * float(update.max())
        assert float(diff.max()) <= tol, (
            f"{what}: weights differ by {float(diff.max()):.3g} (> {tol:.3g}; largest update {float(update.max()):.3g})"
        )
    else:
        tail = float(diff.quantile(0.999))
        tol = 2e-6 + 2e-3 * float(update.max())
        assert tail <= tol and float(diff.max()) <= 2 * float(update.max()), (
            f"{what}: 0.1 % of weights differ by more than {tail:.3g} (> {tol:.3g}), at most by {float(diff.max()):.3g}"
        )


def _adapters(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    source = AdapterWeights(peft_model, zero_stage=0)
    with source.gathered([m.name for m in source.metas()]) as tensors:
        return {n: t.detach().clone() for n, t in tensors.items()}


# The metrics of the correction for the engine's sampling, which both sides must log.
CORRECTION_METRICS = {
    "tis": {"policy/tis_weight", "policy/tis_capped_frac"},
    "decoupled": {"policy/decoupled_weight", "policy/decoupled_dropped_frac"},
}


def _assert_metrics_close(system: dict[str, float], oracle: dict[str, float], what: str, correction: str):
    assert set(system) == set(oracle), f"{what}: logged only by one side: {sorted(set(oracle) ^ set(system))}"
    assert {"loss/policy", "policy/clipfrac", "policy/approx_kl", "policy/grad_norm", "policy/entropy"} <= set(system)
    assert CORRECTION_METRICS[correction] <= set(system), what
    for key in sorted(system):
        rel = 1e-3 if key.endswith("grad_norm") else 1e-4
        assert system[key] == pytest.approx(oracle[key], rel=rel, abs=1e-6), (
            f"{what}: {key} = {system[key]!r}, the oracle says {oracle[key]!r}"
        )


@pytest.fixture(scope="module")
def initial_weights(tiny_model_path):
    return {
        "policy": {n: p.detach().clone() for n, p in load_policy(tiny_model_path, "float32", "cpu").named_parameters()},
        "critic": {n: p.detach().clone() for n, p in load_critic(tiny_model_path, "float32", "cpu").named_parameters()},
        "adapters": _adapters(apply_lora(load_policy(tiny_model_path, "float32", "cpu"), LORA, SEED)),
    }


CASES = list(itertools.product(ALGORITHMS, LOSS_AGGREGATIONS))
LAYOUTS = list(itertools.product(TRANSFERS, (1, 2)))  # transfer x policy ranks


def _settings(case: int) -> list[tuple]:
    """(ppo_epochs, optimizer, transfer, ranks, cut) of one algo x loss_agg case: with SGD every
    transfer x ranks x cut at two epochs; with Adam every cut x epochs 1 and 2 on one transfer x
    ranks, rotated over the cases so that every algo and every loss_agg meets each transfer and rank
    count under Adam too (SGD catches scale errors; Adam's own check is its path, moments and bias
    correction). SGD runs two epochs only: one epoch's update is the first half of two epochs' (the
    weights and metrics of the second depend on it), and one epoch alone is checked under Adam."""
    sgd = [(2, "sgd", t, r, c) for (t, r), c in itertools.product(LAYOUTS, CUTS)]
    transfer, ranks = LAYOUTS[case % len(LAYOUTS)]
    return sgd + [(e, "adamw", transfer, ranks, c) for e, c in itertools.product((1, 2), CUTS)]


# CI (`make test`) checks every algo once, the loss aggregations rotated over them (each one at least
# once, token-mean -- where the critic trains -- with PPO), every setting of `_settings` each; the
# full tier (`make test-full`) checks the whole product.
CI_CASES = [(name, LOSS_AGGREGATIONS[i % len(LOSS_AGGREGATIONS)]) for i, name in enumerate(ALGORITHMS)]


@pytest.mark.parametrize(
    "name,agg",
    [pytest.param(*c, marks=[] if c in CI_CASES else [pytest.mark.extended]) for c in CASES],
    ids=[f"{a}-{g}" for a, g in CASES],
)
def test_trainer_matches_the_oracle(actors, initial_weights, tiny_model_path, name, agg):
    """All transfers x ranks x cuts x epochs x optimizers for one algo and one loss aggregation."""
    _check_against_the_oracle(actors, initial_weights, tiny_model_path, name, agg, CASES.index((name, agg)), "tis")


# Decoupled PPO: every loss aggregation once, each with another algo (the weights enter every
# algo's loss in the same place -- the per-token weight TIS uses -- so one algo per aggregation
# covers where they could go wrong; the suite's time is the budget: docs/testing.md).
DECOUPLED_CASES = [(name, LOSS_AGGREGATIONS[i]) for i, name in enumerate(ALGORITHMS[: len(LOSS_AGGREGATIONS)])]


# (the full tier only: CI runs decoupled PPO end to end in test_env_integration's async tool-use run)
@pytest.mark.extended
@pytest.mark.parametrize("name,agg", DECOUPLED_CASES, ids=[f"{a}-{g}" for a, g in DECOUPLED_CASES])
def test_trainer_matches_the_oracle_with_decoupled_ppo(actors, initial_weights, tiny_model_path, name, agg):
    """AReaL's decoupled PPO weights (tokens above the cap dropped) instead of truncated IS: all
    transfers x ranks x cuts x epochs x optimizers for one algo and one loss aggregation."""
    metrics = _check_against_the_oracle(
        actors, initial_weights, tiny_model_path, name, agg, DECOUPLED_CASES.index((name, agg)), "decoupled"
    )
    # The cap is live: some tokens are dropped, most are kept.
    assert all(0.0 < m["policy/decoupled_dropped_frac"] < 0.5 for m in metrics)


def _check_against_the_oracle(
    actors,
    initial_weights,
    tiny_model_path,
    name,
    agg,
    case,
    correction,
    lora=None,
    settings_of=None,
    kl_placement=None,
    distill_coef=None,
) -> list[dict]:
    """Every setting of `_settings(case)` (or `settings_of(case)`) through the system, each held to
    the oracle; returns the system's metrics of each setting. `lora`: the policy trains LoRA adapters;
    `kl_placement` / `distill_coef`: another than the algo option's."""
    settings_of = settings_of or _settings
    # The critic's update does not depend on the policy's loss aggregation: it is checked with
    # token-mean; the other aggregations' cases use its values for GAE and leave it untrained.
    train_critic = agg == "token-mean"
    pending = [
        (
            settings,
            _submit_update(
                actors,
                tiny_model_path,
                _algo(name, agg, settings[0], correction, kl_placement, distill_coef),
                *settings[2:],
                settings[1],
                train_critic,
                lora,
            ),
        )
        for settings in settings_of(case)
    ]
    oracles, checked = {}, []
    for (epochs, optimizer, transfer_name, ranks, cut), refs in pending:
        what = f"algo={name} loss_agg={agg} {correction} ppo_epochs={epochs} {optimizer} transfer={transfer_name} ranks={ranks} cut={cut}"
        what += f" lora rank={lora.rank}" if lora else ""
        algo = _algo(name, agg, epochs, correction, kl_placement, distill_coef)
        system = _collect(refs, algo)
        # trainer.old_logprobs=auto: the update's own forward gives the old log-probs exactly where
        # they are the same (the oracle computes them with a forward of their own either way).
        assert system["old_from_update"] == {_old_logprobs_from_update(algo, cut)}, what
        steps = system["policy_steps"]
        per_epoch = len(steps) // epochs
        for e in range(epochs):  # every epoch's steps partition the rollout
            assert sorted(i for step in steps[e * per_epoch : (e + 1) * per_epoch] for i in step) == list(
                range(len(SAMPLES))
            ), what
        # The oracle depends on the cut only through which sequences shared a step.
        key = (epochs, optimizer, str(system["policy_steps"]), str(system["critic_steps"]))
        if key not in oracles:
            oracles[key] = _oracle(
                tiny_model_path, algo, optimizer, system["policy_steps"], system["critic_steps"], lora
            )
        oracle = oracles[key]
        _assert_metrics_close(system["metrics"], oracle.metrics, what, correction)
        _assert_dump_shows_what_trained(system["dumped"], oracle, what)
        checked.append(system["metrics"])
        initial = initial_weights["policy"] if lora is None else initial_weights["adapters"]
        _assert_weights_close(
            system["policy"], oracle.policy, initial, optimizer, what + " (policy)", adapters=lora is not None
        )
        if algo.needs_critic and train_critic:
            _assert_weights_close(
                system["critic"], oracle.critic, initial_weights["critic"], optimizer, what + " (critic)"
            )
    return checked


def _assert_dump_shows_what_trained(dumped: list[dict], oracle, what: str) -> None:
    """The rollout dump's per-token values of every sequence (kept by the ranks through the update)
    are the oracle's: pi_old -- from the experience forward or the update's own -- and the
    advantage of each model token (rounded to 4 decimals in the dump)."""
    assert sorted(s["index"] for s in dumped) == sorted(s.index for s in SAMPLES), what
    by_index = {s.index: k for k, s in enumerate(SAMPLES)}
    for seq in dumped:
        k = by_index[seq["index"]]
        first = len(SAMPLES[k].prompt_ids)
        model = [t for t, a in enumerate(seq["action"]) if a]
        assert all(t >= first for t in model), what
        if not model:  # (an empty or wholly masked response: nothing trained, nothing to show)
            continue
        trainer = torch.tensor([seq["trainer_logprobs"][t] for t in model])
        advantage = torch.tensor([seq["token_advantages"][t] for t in model])
        offsets = [t - first for t in model]
        torch.testing.assert_close(trainer, oracle.old_logprobs[k][offsets].float(), atol=2e-4, rtol=0, msg=what)
        torch.testing.assert_close(advantage, oracle.advantages[k][offsets].float(), atol=2e-4, rtol=1e-4, msg=what)


def _old_logprobs_from_update(algo, cut: str) -> bool:
    """Whether the trainer is to take the old log-probs from the update's forward: one epoch of one
    optimizer step (the one-step cut), no KL in the reward and no teacher term (the tiny model has
    no dropout)."""
    return algo.ppo_epochs == 1 and cut == "one_step" and not algo.kl_in_reward and not algo.uses_teacher


def test_the_teacher_term_beside_another_algorithm_matches_the_oracle(actors, initial_weights, tiny_model_path):
    """Distillation beside RL: PPO (GAE over KL-shaped rewards, whitened; the critic trains) with the
    teacher's term added (algo.distill_coef=0.5): Adam, one epoch of one step over two packed ranks
    (where the update's own forward could have given the old log-probs, but the teacher term reads
    them first), and SGD over two epochs of two steps on one micro-batched rank. (on_policy_distill's
    own cases take every transfer x ranks x cut.)"""
    settings = [(1, "adamw", "packed", 2, "one_step"), (2, "sgd", "micro_batched", 1, "two_steps")]
    metrics = _check_against_the_oracle(
        actors, initial_weights, tiny_model_path, "ppo", "token-mean", 0, "tis",
        settings_of=lambda case: settings, distill_coef=0.5,
    )  # fmt: skip
    assert all(m["distill/reverse_kl"] != 0.0 for m in metrics)


def test_the_critic_s_update_with_the_old_logprobs_from_the_policy_update_matches_the_oracle(
    actors, initial_weights, tiny_model_path
):
    """PPO with its KL in the loss (the cases above put it in the reward, which reads the old
    log-probs): its GAE and the critic's update where the update's own forward gives the old
    log-probs, on each transfer over two ranks, Adam, one epoch of one step; and one fallback."""
    settings = [(1, "adamw", t, 2, "one_step") for t in TRANSFERS] + [(1, "adamw", "packed", 1, "two_steps")]
    _check_against_the_oracle(
        actors, initial_weights, tiny_model_path, "ppo", "token-mean", 0, "tis",
        settings_of=lambda case: settings, kl_placement="in_loss",
    )  # fmt: skip


def test_the_matrix_has_every_algo_option():
    conf = Path(__file__).resolve().parents[2] / "conf" / "algo"
    assert sorted(ALGORITHMS) == sorted(p.stem for p in conf.glob("*.yaml"))


def test_the_ci_cases_take_the_old_logprobs_both_ways():
    """CI's cases run the update with the old log-probs from its own forward (trainer.old_logprobs=auto,
    where exact) and from the experience phase's forward, with and without LoRA."""
    for cases, settings_of in ((CI_CASES, _settings), (LORA_CASES, _lora_settings)):
        ways = {
            _old_logprobs_from_update(_algo(name, agg, s[0], "tis"), s[4])
            for name, agg in cases
            for s in settings_of(cases.index((name, agg)) if cases is LORA_CASES else CASES.index((name, agg)))
        }
        assert ways == {True, False}


# model.lora: the policy trains its adapters only. Every algo once (loss aggregations rotated), two
# settings each rotated over transfer x ranks x cut: SGD over two epochs (scale errors) and Adam (one
# epoch on every other case: with the one-step cut, the old log-probs from the update's forward); the
# critic is a full model and trains as in the cases above. The oracle wraps the same initial model
# with the same adapters (PEFT, A from the seed, B = 0) and updates them in plain PyTorch.
LORA_CASES = [(name, LOSS_AGGREGATIONS[i % len(LOSS_AGGREGATIONS)]) for i, name in enumerate(ALGORITHMS)]


def _lora_settings(case: int) -> list[tuple]:
    sgd_layout, adam_layout = LAYOUTS[case % len(LAYOUTS)], LAYOUTS[(case + 3) % len(LAYOUTS)]
    cuts = list(CUTS)
    adam_epochs = 1 if case % 2 else 2  # (odd cases: Adam's cut is the one-step one)
    return [(2, "sgd", *sgd_layout, cuts[case % 2]), (adam_epochs, "adamw", *adam_layout, cuts[(case + 1) % 2])]


@pytest.mark.parametrize("name,agg", LORA_CASES, ids=[f"{a}-{g}" for a, g in LORA_CASES])
def test_trainer_matches_the_oracle_with_lora(actors, initial_weights, tiny_model_path, name, agg):
    """The adapters' update through the system (DeepSpeed ZeRO-2 over the PEFT model) is the oracle's."""
    _check_against_the_oracle(
        actors,
        initial_weights,
        tiny_model_path,
        name,
        agg,
        LORA_CASES.index((name, agg)),
        "tis",
        lora=LORA,
        settings_of=_lora_settings,
    )


def test_the_packed_cases_run_shared_prompts():
    """The packed cases above exercise trainer.share_prompts: with the one-step cut, on 1 and 2 ranks,
    some micro-batches hold a prompt once (else sharing could break unseen). (The two-step cut's
    24-token budget packs 2-3 sequences of different lengths together: no two samples of a prompt.)"""
    from rlhf_orch.trainer.shared_prompts import shared_prompt_layout

    for cut, (micro, _, budget) in [("one_step", CUTS["one_step"])]:
        for ranks in (1, 2):
            mbs = [mb for shard in _transfer("packed", budget).layout(SAMPLES, ranks, micro, 0) for mb in shard]
            assert any(shared_prompt_layout(mb) is not None for mb in mbs), (cut, ranks)
