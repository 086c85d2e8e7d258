"""Checkpoint bookkeeping without Ray: atomic commit, rotation, which checkpoint `resume=` takes,
config drift, the metrics file on resume, the NaN guard, stop signals, engine seeds."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_orch.logging.base import MetricsFile, read_metrics
from rlhf_orch.checkpoint_dirs import (
    DRIVER_STATE,
    CheckpointStore,
    ResumeError,
    complete_checkpoints,
    find_checkpoint,
    run_checkpoint_root,
    run_dir_of,
)
from rlhf_orch.orchestration.checkpoint import (
    checkpoint_zero_stages,
    config_drift,
    engine_seed,
    load_driver_state,
    load_resume,
)
from rlhf_orch.orchestration.loop import non_finite
from rlhf_orch.rng import rng_state, set_rng_state
from rlhf_orch.orchestration.signals import SignalAbort, StopRequest

CONFIG = {
    "model": {"hidden_size": 128},
    "algo": {"num_steps": 10, "actor_lr": 1e-4},
    "logger": {"_target_": "x"},
    "resume": None,
}


def _commit(store: CheckpointStore, step: int, run_dir: Path, config=CONFIG, experiment_name: str = "quick") -> Path:
    tmp = store.begin(step)
    torch.save({"step": step, "config": config, "metrics": [], "data": {}}, tmp / DRIVER_STATE)
    return store.commit(tmp, step, {"run_dir": str(run_dir), "experiment_name": experiment_name})


def test_commit_is_atomic_and_rotation_keeps_the_last(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    for step in (1, 2, 3):
        _commit(store, step, tmp_path)
    assert [c.step for c in store.complete()] == [2, 3]
    # A checkpoint being written when the process died: never the latest, cleaned by the next commit.
    half = store.begin(4)
    (half / "policy").mkdir()
    assert store.latest().step == 3
    assert find_checkpoint(str(tmp_path), tmp_path.parent).step == 3
    _commit(store, 5, tmp_path)
    assert not half.exists()
    assert [c.step for c in store.complete()] == [3, 5]
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)


def test_resume_finds_a_checkpoint_dir_a_run_dir_or_the_latest_of_the_experiment(tmp_path):
    experiment = tmp_path / "outputs" / "quick"
    old, new = experiment / "2026-01-01_00-00-00", experiment / "2026-01-02_00-00-00"
    _commit(CheckpointStore(old / "checkpoints", 3), 7, old)
    time.sleep(0.01)
    ck = _commit(CheckpointStore(new / "checkpoints", 3), 2, new)
    assert find_checkpoint(str(ck), experiment).path == ck
    assert find_checkpoint(str(old), experiment).step == 7
    assert find_checkpoint("auto", experiment).path == ck  # the most recently written, not the highest step
    assert run_dir_of("auto", str(experiment / "now")) == str(new)
    assert run_dir_of(None, "default") == "default"
    assert run_dir_of(str(tmp_path / "missing"), "default") == "default"  # reported later, by the app
    with pytest.raises(ResumeError, match="no such directory"):
        find_checkpoint(str(tmp_path / "missing"), experiment)
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        find_checkpoint("auto", tmp_path / "outputs" / "other")
    # A checkpoint directory shared by experiments: auto takes this experiment's newest only.
    shared = tmp_path / "shared"
    mine = _commit(CheckpointStore(shared, 3), 4, old, experiment_name="quick")
    time.sleep(0.01)
    _commit(CheckpointStore(shared / "theirs", 3), 9, tmp_path / "theirs", experiment_name="other")
    with pytest.raises(
        ResumeError, match=r"no complete checkpoint of experiment_name='quick'.*\(1 of other experiments\)"
    ):
        find_checkpoint("auto", tmp_path / "nowhere", str(shared / "theirs"), "quick")
    assert find_checkpoint("auto", tmp_path / "nowhere", str(shared), "quick").path == mine
    assert find_checkpoint("auto", tmp_path / "nowhere", str(shared / "theirs"), "other").step == 9
    empty = tmp_path / "killed_before_first_checkpoint"
    empty.mkdir()
    with pytest.raises(ResumeError, match="cannot be resumed"):
        find_checkpoint(str(empty), experiment)


def test_runs_sharing_a_checkpoint_dir_keep_and_resume_their_own_checkpoints(tmp_path):
    """Two runs of one experiment write into one checkpoint.dir with keep_last=1, interleaved:
    neither rotation deletes the other's checkpoint, and each run dir resumes its own."""
    shared = str(tmp_path / "shared")
    outputs = tmp_path / "outputs" / "quick"
    a, b = outputs / "2026-01-01_00-00-00", outputs / "2026-01-01_00-00-01"
    a.mkdir(parents=True), b.mkdir()  # the run dirs (metrics, logs); their checkpoints are in `shared`
    store_a = CheckpointStore(run_checkpoint_root(a, shared), keep_last=1)
    store_b = CheckpointStore(run_checkpoint_root(b, shared), keep_last=1)
    assert store_a.root != store_b.root and store_a.root.parent == store_b.root.parent == Path(shared)
    for step in (1, 2, 3):
        _commit(store_a, step, a)
        time.sleep(0.01)
        _commit(store_b, step, b)  # the same step names: each in its own directory
    assert [c.step for c in store_a.complete()] == [3] and [c.step for c in store_b.complete()] == [3]
    assert find_checkpoint(str(a), outputs, shared).manifest["run_dir"] == str(a)
    assert find_checkpoint(str(b), outputs, shared).manifest["run_dir"] == str(b)
    assert run_dir_of(str(a), "default", "quick", shared) == str(a)
    assert find_checkpoint("auto", outputs, shared, "quick").manifest["run_dir"] == str(b)  # the newest
    # Two run dirs with one name (two experiments' roots): still two directories.
    assert run_checkpoint_root(tmp_path / "x" / "run", shared) != run_checkpoint_root(tmp_path / "y" / "run", shared)
    assert run_checkpoint_root(a) == a / "checkpoints"
    # The run dir named through a symlink (or `.`, or a relative path): the same directory.
    (tmp_path / "latest").symlink_to(a)
    assert run_checkpoint_root(tmp_path / "latest", shared) == store_a.root
    # A run started without checkpoint.dir and resumed with it has checkpoints in both: the newest counts.
    _commit(CheckpointStore(a / "checkpoints", 2), 1, a)
    assert find_checkpoint(str(a), outputs, shared).step == 3


def test_one_rank_roles_run_zero_1_and_2_as_stage_0_and_a_checkpoint_s_stages_win():
    """A role of one rank has nothing to partition: ZeRO-1/2 run as stage 0 (not with offload, which
    needs ZeRO; ZeRO-3 as set). A resumed checkpoint's roles run the stage their state was written
    at: as its driver state records it, or (written before the rule) trainer.zero_stage."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlhf_orch.orchestration.session import trainer_specs
    from rlhf_orch.trainer.deepspeed_config import zero_stage_to_run
    from tests.conftest import compose_config

    assert [zero_stage_to_run(stage, 1, False) for stage in range(4)] == [0, 0, 0, 3]
    assert [zero_stage_to_run(stage, 2, False) for stage in range(4)] == [0, 1, 2, 3]
    assert zero_stage_to_run(2, 1, offload_optimizer=True) == 2
    config = {"trainer": {"zero_stage": 2}}
    assert checkpoint_zero_stages({"config": config}) == {"actor": 2, "critic": 2}
    assert checkpoint_zero_stages({"config": config, "zero_stages": {"actor": 0, "critic": 0}}) == {
        "actor": 0,
        "critic": 0,
    }
    cfg = compose_config(["algo=ppo", "placement.critic_ranks=2"])  # (conf/config.yaml: trainer.zero_stage=2)
    typed = OmegaConf.to_object(cfg)
    plan = instantiate(cfg.placement).plan(reward_model=False, critic=True, reference=True)
    stage = lambda written=None: {  # noqa: E731
        role: s.zero_stage
        for role, s in trainer_specs(typed, plan, "m", 0, None, written).items()
        if role != "reference"
    }
    assert stage() == {"actor": 0, "critic": 2}
    assert stage({"actor": 2, "critic": 2}) == {"actor": 2, "critic": 2}


def test_config_drift_refuses_breaking_changes_and_lists_the_rest(tmp_path):
    changed = {
        **CONFIG,
        "model": {"hidden_size": 256},
        "algo": {"num_steps": 20, "actor_lr": 2e-4},
        "logger": {"_target_": "y"},
    }
    breaking, other, harmless = config_drift(CONFIG, changed)
    assert breaking == ["model.hidden_size"]
    assert other == ["algo.actor_lr"]
    assert harmless == ["algo.num_steps", "logger._target_"]
    assert config_drift(CONFIG, {**CONFIG, "resume": "auto"}) == ([], [], [])
    assert config_drift({"placement": {"actor_ranks": 1}}, {"placement": {"actor_ranks": 2}})[0] == [
        "placement.actor_ranks"
    ]
    assert config_drift({"trainer": {"zero_stage": 2}}, {"trainer": {"zero_stage": 3}})[0] == ["trainer.zero_stage"]

    ck = _commit(CheckpointStore(tmp_path / "checkpoints", 2), 4, tmp_path)
    with pytest.raises(ResumeError, match="different model.hidden_size"):
        load_resume(str(ck), tmp_path, None, changed, num_steps=20)
    # Resuming at (or past) the last step would silently run nothing: refused, with the fix.
    with pytest.raises(ResumeError, match="algo.num_steps=4 leaves nothing to run"):
        load_resume(str(ck), tmp_path, None, {**CONFIG, "algo": {"num_steps": 4, "actor_lr": 1e-4}}, num_steps=4)
    point = load_resume(str(ck), tmp_path, None, {**CONFIG, "algo": {"num_steps": 20, "actor_lr": 1e-4}}, num_steps=20)
    assert point.step == 4 and point.changed == ["algo.num_steps"]


def test_metrics_file_on_resume_marks_the_steps_after_the_checkpoint_superseded(tmp_path):
    """Steps 3 and 4 ran after the checkpoint of step 2 and are run again: their records stay (what
    happened), marked superseded; `read_metrics` gives every step once, from the run that counts."""
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) for s in range(0, 5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "rew')  # killed mid-write
    f = MetricsFile(tmp_path, keep_through_step=2)
    f.write({"step": 3, "reward/mean": 0.9})
    f.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["reward/mean"] == 0.9
    every = read_metrics(tmp_path, include_superseded=True)
    assert [(r["step"], r.get("superseded", False)) for r in every] == [
        (0, False),
        (1, False),
        (2, False),
        (3, True),
        (4, True),
        (3, False),
    ]
    # A second restart from the same checkpoint marks the re-run's records too, once.
    MetricsFile(tmp_path, keep_through_step=2).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert len(read_metrics(tmp_path, include_superseded=True)) == 6


def test_rng_state_round_trip_and_engine_seeds(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    a = (torch.rand(3), __import__("random").random(), np.random.rand(2))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # data only: loads without pickled code
    assert torch.equal(torch.rand(3), a[0]) and __import__("random").random() == a[1]
    assert np.array_equal(np.random.rand(2), a[2])
    seeds = {engine_seed(1, step, e) for step in range(1, 50) for e in range(4)}
    assert len(seeds) == 49 * 4  # distinct per (step, engine)
    assert engine_seed(1, 3, 0) == engine_seed(1, 3, 0) != engine_seed(2, 3, 0)


def test_non_finite_names_the_quantity():
    assert non_finite({"reward/mean": 0.5, "loss/policy": 0.1, "time/step": float("nan")}) == []
    bad = non_finite({"reward/mean": 0.5, "loss/policy": float("nan"), "policy/grad_norm": float("inf")})
    assert bad == ["loss/policy=nan", "policy/grad_norm=inf"]


def test_first_signal_asks_to_stop_second_aborts():
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(SignalAbort) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert info.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # restored


def test_complete_checkpoints_ignores_foreign_dirs(tmp_path):
    (tmp_path / "step_00000003").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "notes").mkdir()
    assert complete_checkpoints(tmp_path) == []


class _RunsCodeOnLoad:
    """Unpickling this calls os.system: what a hostile checkpoint would do."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_driver_state_loads_data_and_rollouts_only(tmp_path):
    from rlhf_orch.transfer.base import HeldRollout
    from rlhf_orch.transfer.batch import Sample
    from rlhf_orch.transfer.engine_side import RolloutMeta

    sample = Sample(
        torch.tensor([1, 2]), torch.tensor([3]), 1.0, torch.tensor([-0.5]), 1, 0, False, {"values": torch.tensor([0.1])}
    )
    held = HeldRollout(
        meta=RolloutMeta([0], [3], [1], [1.0]),
        held=[[sample]],
        num_shards=1,
        micro_batch_size=1,
        pad_id=0,
        max_seq_len=8,
    )
    torch.save(
        {"step": 1, "rng": rng_state(), "pending_rollout": held, "metrics": [{"kl": 0.5}]}, tmp_path / DRIVER_STATE
    )
    state = load_driver_state(tmp_path / DRIVER_STATE)
    assert state["pending_rollout"].held[0][0].fields["values"].tolist() == pytest.approx([0.1])

    torch.save({"step": 1, "payload": _RunsCodeOnLoad()}, tmp_path / "hostile.pt")
    with pytest.raises(ResumeError, match=r"holds more than data \(it would import posix.system"):
        load_driver_state(tmp_path / "hostile.pt")


def test_resume_run_dir_takes_the_run_dir_s_own_checkpoint_or_starts_fresh_there(tmp_path, capsys):
    """resume=run_dir (a requeued Slurm job, hydra.run.dir fixed per job): the run dir's newest
    checkpoint -- never another job's of the same experiment, even a newer one (what resume=auto
    would take) -- or, when the first attempt made none, a fresh start in it."""
    from omegaconf import OmegaConf

    from rlhf_orch.orchestration.session import load_resume_point
    from tests.conftest import compose_config

    experiment = tmp_path / "outputs" / "quick"
    mine, other = experiment / "slurm-101", experiment / "slurm-102"
    cfg = compose_config(["experiment=quick", "algo.num_steps=10", "resume=run_dir", f"hydra.run.dir={mine}"])
    typed = OmegaConf.to_object(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)

    class Task:  # the data sampler's position is all load_resume_point touches
        drawn = 0

        def state_dict(self) -> dict:
            return {"drawn": self.drawn}

        def load_state_dict(self, state: dict) -> None:
            self.drawn = state["drawn"]

    task = Task()

    mine.mkdir(parents=True)
    assert load_resume_point(typed, mine, config, task) is None  # no checkpoint yet: fresh
    assert "resume=run_dir: no complete checkpoint of" in capsys.readouterr().out

    def commit(run_dir: Path, step: int) -> Path:
        tmp = CheckpointStore(run_dir / "checkpoints", 3).begin(step)
        torch.save(
            {
                "step": step,
                "config": config,
                "metrics": [],
                "data": {"drawn": step},
                "rng": rng_state(),
                "weight_version": step,
            },
            tmp / DRIVER_STATE,
        )
        return CheckpointStore(run_dir / "checkpoints", 3).commit(
            tmp, step, {"run_dir": str(run_dir), "experiment_name": "quick"}
        )

    ours = commit(mine, 3)
    time.sleep(0.01)
    commit(other, 5)  # another job of the same experiment, written later
    assert find_checkpoint("auto", experiment, None, "quick").step == 5
    assert run_dir_of("run_dir", str(mine)) == str(mine)
    resumed = load_resume_point(typed, mine, config, task)
    assert resumed is not None and resumed.info.path == ours and resumed.step == 3 and task.drawn == 3


def test_a_requeued_job_given_a_checkpoint_by_hand_continues_from_what_it_wrote_after_it(tmp_path, capsys):
    """A job given resume=<step 20 of run D> by hand (D went on to step 40 before). The resume sets
    D's steps 30 and 40 aside (another timeline: kept, never the newest), so the job's own steps 25
    and 30 are D's newest -- not rotated away by the old ones -- and its requeued attempt continues
    from its step 30, not from the hand-given step 20 again (rotated away by then: keep_last=2)."""
    import sys

    from rlhf_orch.orchestration.run_record import RunRecord
    from tests.conftest import compose_config
    from tests.orchestration.test_loop_consistency import _Logger, _Task

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from launchers.slurm.requeue_resume import requeue_resume

    outputs = tmp_path / "outputs"
    run = outputs / "quick" / "D"
    store = CheckpointStore(run / "checkpoints", keep_last=3)
    step_20 = _commit(store, 20, run)
    for step in (30, 40):
        _commit(store, step, run)

    cfg = compose_config(["experiment=quick", "checkpoint.keep_last=2", f"resume={step_20}"])
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlhf_orch.app import check

    typed, _ = check(cfg, instantiate(cfg.launcher))
    resume = load_resume(str(step_20), outputs, None, CONFIG, num_steps=50)
    record = RunRecord(run, typed, OmegaConf.to_container(cfg, resolve=True), _Logger(), _Task(), resume)
    assert [c.step for c in record.store.complete()] == [20]
    kept = sorted(p.name.rsplit("-", 1)[0] for p in (run / "checkpoints" / "superseded").iterdir())
    assert kept == ["step_00000030", "step_00000040"]  # nothing produced is lost
    assert "is of a timeline this run goes back past" in capsys.readouterr().out
    for step in (25, 30):  # the resumed run's own checkpoints
        _commit(record.store, step, run)
    assert [c.step for c in record.store.complete()] == [25, 30]  # (the hand-given step 20 rotated away)
    assert requeue_resume(["experiment=quick", f"resume={step_20}"], outputs) == str(
        run / "checkpoints" / "step_00000030"
    )
    assert requeue_resume(["experiment=quick"], outputs) == "run_dir"  # not given by hand: the job's own run dir
