"""trainer.reference_memory: the KL reference sharded by DeepSpeed ZeRO-3 over its ranks (in
processes of its own, or inside the policy ranks' processes) computes the reference it names, and
settings that do nothing or cannot hold are refused before any actor starts."""

from __future__ import annotations

import pytest
import ray
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.config.problems import ConfigError
from rlhf_orch.logging.base import read_metrics
from tests.conftest import compose_config, train_in_process

pytestmark = pytest.mark.integration  # its runs share the module's Ray session, on one xdist worker

# GRPO with its KL term on two policy ranks and two reference ranks.
TWO_RANKS = [
    "experiment=quick",
    "algo=grpo",
    "algo.kl_coef=0.1",
    "placement.actor_ranks=2",
    "placement.reference_ranks=2",
]


@pytest.mark.extended  # both layouts (~90 s each in CI's tier): docs/testing.md says what CI runs of it
@pytest.mark.parametrize("hosted", ["false", "true"])
def test_a_sharded_reference_is_the_initial_policy(tmp_path, hosted, shared_ray):
    """Step 1 trains from the reference's own weights: the KL between the policy's old log-probs and
    the sharded reference's is zero only if every rank's forward gathered the whole model. Step 2's
    policy has moved: the KL is positive."""
    overrides = [*TWO_RANKS, f"placement.reference_in_actor={hosted}", "trainer.reference_memory=sharded", *shared_ray]
    cfg = compose_config(overrides)
    _, plan = check(cfg, instantiate(cfg.launcher))
    assert plan.reference_in_actor == (hosted == "true")
    held: list[tuple[int, int]] = []

    def shards(step: int, loop) -> None:  # what each rank's reference holds of its parameters
        if step == 1:
            ranks = loop.actors.policy if hosted == "true" else loop.actors.reference
            held.extend(ray.get([rank.__ray_call__.remote(_held_of_reference) for rank in ranks]))

    train_in_process(overrides, tmp_path, callbacks=[shards])
    kl = [row["kl"] for row in read_metrics(tmp_path)]
    assert len(kl) == 2 and abs(kl[0]) < 1e-6 and abs(kl[1]) > 1e-6, kl
    # ZeRO-3 over 2 ranks: each keeps about half of every parameter (partitions are padded to the ranks)
    assert len(held) == 2 and all(local < 0.55 * whole for local, whole in held), held


def _held_of_reference(worker) -> tuple[int, int]:
    """(elements this rank keeps, elements of the whole model) of the rank's reference."""
    model = worker.frozen["ref"]
    params = list(model.parameters())
    return (
        sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
        sum(getattr(p, "ds_numel", p.numel()) for p in params),
    )


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["algo=dapo", "trainer.reference_memory=sharded"], "does nothing: the algorithm has no KL reference"),
        (["trainer.reference_memory=sharded"], "sharding over one reference rank keeps the whole model"),
        ([*TWO_RANKS, "trainer.reference_memory=offloaded"], "without CUDA GPUs it is in host memory already"),
        (
            [*TWO_RANKS, "placement.reference_in_actor=true", "model.lora.rank=4", "trainer.reference_memory=sharded"],
            "the policy's own frozen base",
        ),
        (["trainer.reference_memory=zero3"], "use full"),
    ],
)
def test_a_reference_memory_setting_that_does_nothing_or_cannot_hold_is_refused(overrides, fragment):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match="trainer.reference_memory") as refused:
        check(cfg, instantiate(cfg.launcher))
    assert fragment in str(refused.value)
