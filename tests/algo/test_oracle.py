"""The oracle's advantages and aggregation against the estimators', on masks with holes (pure).

`rlhf_orch.algo.oracle` writes every formula again, per sequence, in plain loops; the estimators
(`rlhf_orch.algo.estimators`, what the trainer runs) are vectorised over `[B, T]` rows. Here they
meet on a rollout whose response masks have holes (tokens a multi-turn rollout does not train
on, such as a tool's output) -- which the end-to-end matrix (`test_oracle_matrix.py`) cannot feed
through the transfer layouts yet -- and on an empty response, a group of one and a group of equal
scores.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from rlhf_orch.algo.estimators import TargetRows
from rlhf_orch.algo.losses import LOSS_AGGREGATIONS, aggregate_loss
from rlhf_orch.algo.oracle import ADVANTAGES, Rollout, _aggregate, advantages
from tests.conftest import compose_config

# Every `algo` option (conf/algo/*.yaml): a new one without a specification fails below.
ALGORITHMS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "algo").glob("*.yaml"))
MAX_LEN = 8


def _rollout() -> tuple[Rollout, list[torch.Tensor], list[torch.Tensor]]:
    rng = random.Random(3)
    n = 14  # groups of 4, 4, 4 and a group of 2; sample 13 is alone in its group id 9
    lengths = [rng.randint(1, MAX_LEN) for _ in range(n)]
    lengths[5] = 0  # an empty response
    responses = [[rng.randint(3, 60) for _ in range(k)] for k in lengths]
    masks = [[int(rng.random() > 0.3) for _ in range(k)] for k in lengths]
    masks[2] = [0] * lengths[2]  # a response with no trained token at all
    scores = [round(rng.random(), 2) for _ in range(n)]
    scores[4:8] = [0.5] * 4  # equal scores
    group_ids = [i // 4 for i in range(n - 1)] + [9]
    rollout = Rollout(
        prompts=[[1, 2] for _ in range(n)],
        responses=responses,
        scores=scores,
        group_ids=group_ids,
        ref_logprobs=[[rng.uniform(-4, -1) for _ in range(k)] for k in lengths],
        loss_masks=masks,
    )
    old = [torch.tensor([rng.uniform(-4, -1) for _ in range(k)]) for k in lengths]
    values = [torch.tensor([rng.uniform(-1, 1) for _ in range(k)]) for k in lengths]
    rollout.teacher_logprobs = [[rng.uniform(-4, -1) for _ in range(k)] for k in lengths]
    return rollout, old, values


def _rows(per_seq: list, width: int) -> torch.Tensor:
    return torch.stack(
        [torch.nn.functional.pad(torch.as_tensor(x, dtype=torch.float32), (0, width - len(x))) for x in per_seq]
    )


def test_every_algo_option_has_a_specification():
    for name in ALGORITHMS:
        algo = instantiate(compose_config([f"algo={name}"]).algo)
        assert type(algo).__name__ in ADVANTAGES, name


@pytest.mark.parametrize("name", ALGORITHMS)
def test_oracle_advantages_equal_the_estimators_on_masks_with_holes(name):
    overrides = [f"algo={name}", "algo.kl_coef=0.1"]
    if name == "dapo":
        overrides.append("algo.overlong_buffer=3")
    if name in ("ppo", "reinforce_pp", "reinforce_pp_baseline"):
        overrides += ["algo.kl_placement=in_reward", "algo.kl_estimator=k2", "algo.gamma=0.9"]
    if name in ("ppo", "grpo"):  # the teacher's term beside the algorithm's own (whitened, group-relative)
        overrides.append("algo.distill_coef=0.3")
    algo = instantiate(compose_config(overrides).algo)
    rollout, old, values = _rollout()
    mask = _rows(rollout.loss_masks, MAX_LEN).bool()
    scores = torch.tensor(rollout.scores)
    group_ids = torch.tensor(rollout.group_ids)
    lengths = torch.tensor([sum(m) for m in rollout.loss_masks])  # the policy's tokens, as the driver counts them
    sample_values, _ = algo.sample_values(scores, group_ids, lengths, MAX_LEN)
    rows = TargetRows(
        mask=mask,
        sample_values=sample_values,
        old_logprobs=_rows(old, MAX_LEN),
        ref_logprobs=_rows(rollout.ref_logprobs, MAX_LEN),
        values=_rows(values, MAX_LEN) if algo.needs_critic else None,
        teacher_logprobs=_rows(rollout.teacher_logprobs, MAX_LEN),
    )
    (targets,) = algo.targets([rows], lambda t: t)
    expected_adv, expected_ret = advantages(algo, rollout, old, values if algo.needs_critic else None, MAX_LEN)
    torch.testing.assert_close(
        torch.where(mask, targets.advantages, 0.0), _rows(expected_adv, MAX_LEN), atol=1e-5, rtol=1e-5
    )
    assert float(_rows(expected_adv, MAX_LEN).abs().sum()) > 0.1  # something to compare
    if algo.needs_critic:
        torch.testing.assert_close(
            torch.where(mask, targets.returns, 0.0), _rows(expected_ret, MAX_LEN), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_oracle_aggregation_equals_aggregate_loss(mode):
    rollout, old, _ = _rollout()
    mask = _rows(rollout.loss_masks, MAX_LEN)
    expected = aggregate_loss(_rows(old, MAX_LEN), mask, mode, norm_len=MAX_LEN)
    got = _aggregate(old, [rollout.mask(i) for i in range(len(old))], mode, MAX_LEN)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
