"""A trainer that shares its GPU gives its cached CUDA memory back as each phase of a step ends
(rlhf_orch/trainer/phase_memory.py): who does (the plan says which processes share a GPU), and that
the workers' phase-ending calls do, with torch.cuda.empty_cache replaced by a recorder (no GPU
here). Pure."""

from __future__ import annotations

import pytest
import torch

from rlhf_orch.trainer.phase_memory import frees_cache_between_phases
from rlhf_orch.trainer.critic import CriticWorker
from rlhf_orch.trainer.policy import PolicyWorker
from rlhf_orch.trainer.reference import ReferenceWorker
from rlhf_orch.trainer.reward_model import RewardModelWorker
from tests.conftest import compose_config
from tests.trainer.specs import plain_spec

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_only_a_process_on_a_shared_cuda_device_frees_its_cache():
    assert frees_cache_between_phases(True, CUDA)
    assert not frees_cache_between_phases(False, CUDA)  # alone on its GPU: nothing else needs what it cached
    assert not frees_cache_between_phases(True, CPU)  # Ray's logical GPUs on a CPU run: no CUDA cache


def _checked(*overrides: str):
    """(typed config, placement plan) of a dry run with `overrides`."""
    from hydra.utils import instantiate

    from rlhf_orch.app import check

    cfg = compose_config(["launcher.dry_run=true", *overrides])
    return check(cfg, instantiate(cfg.launcher))


def _plan(*overrides: str):
    return _checked(*overrides)[1]


def test_the_plan_says_which_roles_share_a_gpu():
    colocated = _plan("placement=colocated", "placement.gpus_per_node=2")
    assert all(colocated.shares_gpu(role) for role in ("actor", "critic", "engine"))  # every role on every GPU
    split = _plan("placement=split")  # engines, actor (hosting its reference) and critic each on GPUs of their own
    assert split.reference_in_actor and not any(split.shares_gpu(role) for role in split.roles)
    apart = _plan("placement=split", "placement.reference_in_actor=false")  # the reference beside the actor on its GPU
    assert apart.shares_gpu("actor") and apart.shares_gpu("reference") and not apart.shares_gpu("critic")
    cpu = _plan()
    assert not any(cpu.shares_gpu(role) for role in cpu.roles)  # no GPU at all


def test_the_specs_carry_it_for_each_role():
    from rlhf_orch.orchestration.session import trainer_specs

    for overrides, shared in (
        (["placement=colocated", "placement.gpus_per_node=2"], True),
        (["placement=split"], False),
    ):
        typed, plan = _checked(*overrides)
        specs = trainer_specs(typed, plan, "unused", 0)
        assert {role: spec.free_cache_between_phases for role, spec in specs.items()} == dict.fromkeys(specs, shared)


# The calls that end a phase of a step in each trainer process: experience, update, scoring.
PHASE_ENDS = {
    PolicyWorker: {"make_experience", "train"},
    CriticWorker: {"values", "train"},
    ReferenceWorker: {"logprobs"},
    RewardModelWorker: {"score"},
}


def test_the_workers_end_a_phase_in_their_experience_update_and_scoring_calls():
    for cls, methods in PHASE_ENDS.items():
        ending = {name for name in dir(cls) if getattr(getattr(cls, name), "ends_a_phase", False)}
        assert ending == methods, cls.__name__


@pytest.fixture
def emptied(monkeypatch) -> list[int]:
    """torch.cuda.empty_cache, recorded (there is no GPU here)."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def _worker(cls, shares_gpu: bool, device: torch.device):
    spec = plain_spec(train_batch_size=1, free_cache_between_phases=shares_gpu)
    worker = cls(spec, 0, 1)
    worker.device = device  # (as a rank on a GPU would hold it; the shard below is empty: nothing runs on it)
    worker._staged = {0: []}
    worker.model = worker.engine = torch.nn.Identity()
    worker.frozen = {"ref": worker.model}
    worker._old_values = {}
    return worker


@pytest.mark.parametrize(
    "cls, call",
    [
        (ReferenceWorker, lambda w: w.logprobs(0)),
        (RewardModelWorker, lambda w: w.score(0)),
        (CriticWorker, lambda w: w.values(0)),
    ],
)
def test_a_phase_ending_call_empties_the_cache_only_on_a_shared_cuda_device(cls, call, emptied):
    call(_worker(cls, True, CUDA))
    assert emptied == [1]
    call(_worker(cls, False, CUDA))
    call(_worker(cls, True, CPU))
    assert emptied == [1]


def test_a_call_that_ends_no_phase_keeps_the_cache(emptied):
    worker = _worker(PolicyWorker, True, CUDA)
    assert worker.step_members() == [] and worker.ping() == 0
    assert emptied == []
