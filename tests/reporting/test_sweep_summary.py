"""Sweep summaries from run dirs written here (no Ray): one row per job whatever state it is in,
summary.csv / summary.md / summary.png, the objective a sweeper gets, and compare_runs."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_orch.reporting.objective import eval_score, objective
from rlhf_orch.reporting.sweep_summary import (
    PHASES,
    is_sweep_dir,
    job_dirs,
    label_rows,
    read_run,
    sweep_rows,
    timed_rows,
    write_sweep_summary,
)

REPO = Path(__file__).resolve().parents[2]


def _step(step: int, reward: float, startup: float = 30.0, warm: bool = False, elapsed: float = 0.0) -> dict:
    """A metrics.jsonl record as TrainLoop + run_training write it (the keys the summary reads, and others)."""
    t = {
        "generate": 1.2,
        "reward": 0.01,
        "transfer": 0.05,
        "transfer_after_generate": 0.05,
        "experience": 0.4,
        "train": 0.9,
        "sync": 0.3,
    }
    if warm:
        t = {k: v * 6 for k, v in t.items()}
    t["step"] = sum(v for k, v in t.items() if k != "transfer_after_generate") + 0.02
    row = {
        "step": step,
        "weight_version": step,
        "reward/mean": reward,
        "reward/max": min(1.0, reward + 0.3),
        "reward/solved_frac": 0.0,
        "rollout/samples": 16,
        "loss/policy": -0.01,
        "kl": 0.001,
        "perf/tokens_per_s": 120.0,
        "fault/engine_restarts": 0,
        **{f"time/{k}": v for k, v in t.items()},
        **{f"share/{k}": t[k] / t["step"] for k in ("generate", "transfer", "experience", "train", "sync")},
        "time/elapsed": elapsed or startup + 20.0 + 3.0 * step,  # rises step by step (warm-up included)
        "time/startup": startup,
    }
    return row


def _summary(run_dir: Path, rows: list[dict], status: str = "completed", **extra) -> dict:
    """summary.json as session.run_summary writes it."""
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = max(1, min(5, len(rewards) // 3))
    evals = [
        {k2: v for k2, v in r.items() if k2 == "step" or k2.startswith("eval/")}
        for r in rows
        if any(k2.startswith("eval/") for k2 in r)
    ]
    return {
        "run_dir": str(run_dir),
        "status": status,
        **extra,
        "steps": max((r["step"] for r in rows), default=0),
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "last_checkpoint": None,
        "wall_s": 100.0,
    }


def _job(
    sweep: Path,
    num: int,
    overrides: list[str],
    rows: list[dict] | None = None,
    summary: dict | None = None,
    error: str | None = None,
) -> Path:
    d = sweep / f"{num}_{','.join(sorted(overrides))}"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if rows is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary, indent=2))
    if error is not None:
        (d / "error.log").write_text(error)
    return d


def _curve(n: int, start: float = 0.1, slope: float = 0.02) -> list[dict]:
    return [_step(s, start + slope * s + (0.03 if s % 2 else -0.03), warm=s == 1) for s in range(1, n + 1)]


def make_sweep(tmp_path: Path) -> Path:
    """A sweep of five jobs: two completed (one with evaluations), one interrupted, one failed with a
    traceback, one that died before writing anything but its .hydra/."""
    s = tmp_path / "multirun" / "quick" / "2026-11-22_07-00-00"
    s.mkdir(parents=True)
    (s / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {"sweep": "sync_strategies"}}}}))
    common = ["experiment=quick", "sweep=sync_strategies"]

    rows = _curve(20)
    d = s / "0_x"
    _job(s, 0, [*common, "sync=gloo_per_tensor"], rows, _summary(d, rows))

    rows = _curve(20, slope=0.03)
    rows.insert(
        0, {"step": 0, "weight_version": 0, "eval/digits/mean@1": 0.2, "eval/digits/pass@1": 0.0, "time/eval": 1.0}
    )
    rows[10]["eval/digits/mean@1"] = 0.35
    rows[-1]["eval/digits/mean@1"] = 0.5
    rows[-1]["eval/digits/pass@1"] = 0.1
    _job(s, 1, [*common, "sync=gloo_bucketed"], rows, _summary(d, rows))

    rows = _curve(6)
    _job(s, 2, [*common, "sync=object_store"], rows, _summary(d, rows, "interrupted", signal="SIGINT"))

    rows = _curve(3)
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\nEngineDiedError: a vLLM engine died while generating\n'
    _job(
        s,
        3,
        [*common, "sync=gloo_multi_sender"],
        rows,
        _summary(d, rows, "failed", error="EngineDiedError: a vLLM engine died while generating"),
        error=tb,
    )

    _job(
        s,
        4,
        [*common, "sync=gloo_multi_sender", "placement.actor_ranks=1"],
        error="exit 2: configuration error\n"
        "  - placement.actor_ranks=1: this sync strategy shards the sending over >= 2 policy ranks\n\n",
    )
    return s


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    return make_sweep(tmp_path)


def test_every_job_is_a_row_with_its_status_and_reason(sweep: Path):
    rows = sweep_rows(sweep)
    assert [r.job for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r.status for r in rows] == ["completed", "completed", "interrupted", "failed", "failed"]
    assert rows[0].reason == ""
    assert rows[2].reason.startswith("stopped by SIGINT")
    assert rows[3].reason == "EngineDiedError: a vLLM engine died while generating"
    assert rows[4].reason == "placement.actor_ranks=1: this sync strategy shards the sending over >= 2 policy ranks"
    assert rows[4].steps == 0 and rows[4].reward_last is None and rows[4].step_s is None and rows[4].curve == []


def test_rewards_eval_and_step_times(sweep: Path):
    rows = sweep_rows(sweep)
    summary = json.loads((sweep / job_dirs(sweep)[0].name / "summary.json").read_text())
    assert rows[0].steps == 20
    assert rows[0].reward_first == pytest.approx(summary["reward_first"])
    assert rows[0].reward_last == pytest.approx(summary["reward_last"])
    assert rows[0].eval_last is None
    assert rows[1].eval_last == pytest.approx(0.5) and rows[1].eval_metric == "eval/digits/mean@1"
    # Step 1 (6x slower: warm-up) is left out of every median.
    assert rows[0].timed_steps == 19
    assert rows[0].phases_s["generate"] == pytest.approx(1.2) and rows[0].phases_s["sync"] == pytest.approx(0.3)
    assert rows[0].step_s == pytest.approx(1.2 + 0.01 + 0.05 + 0.4 + 0.9 + 0.3 + 0.02)
    assert set(rows[0].phases_s) == set(PHASES)
    # The plot's stack adds up to the step (the rest of it is "other").
    assert sum(rows[0].stack_s.values()) == pytest.approx(rows[0].step_s)


def test_failed_job_without_summary_json(tmp_path: Path):
    """Killed mid-run: metrics but no summary.json and no error.log -- the row says so, rewards from the metrics."""
    d = tmp_path / "7_algo=grpo"
    d.mkdir()
    (d / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _curve(9)) + '{"step": 10, "rew'
    )  # cut by a kill
    row = read_run(d)
    assert (row.job, row.status, row.reason, row.steps) == ("7", "failed", "no summary.json", 9)
    rewards = [r["reward/mean"] for r in _curve(9)]
    assert row.reward_first == pytest.approx(sum(rewards[:3]) / 3) and row.reward_last == pytest.approx(
        sum(rewards[-3:]) / 3
    )
    assert row.overrides == ["algo=grpo"]  # no .hydra/: from the dir name


def test_resumed_run_skips_the_warm_up_of_each_process():
    first = [_step(s, 0.1, startup=30.0, warm=s == 1) for s in (1, 2, 3)]
    second = [_step(s, 0.1, startup=41.5, warm=s == 4, elapsed=45.0 + s) for s in (4, 5)]
    assert [r["step"] for r in timed_rows(first + second)] == [2, 3, 5]


def test_only_a_warm_up_step(tmp_path: Path):
    rows = [_step(1, 0.2, warm=True)]
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (d / "summary.json").write_text(json.dumps(_summary(d, rows)))
    row = read_run(d)
    assert row.timed_steps == 0 and row.step_s == pytest.approx(rows[0]["time/step"])


def test_labels_are_the_overrides_that_differ(sweep: Path):
    rows = label_rows(sweep_rows(sweep))
    assert rows[0].label == "sync=gloo_per_tensor"
    assert rows[4].label == "sync=gloo_multi_sender,placement.actor_ranks=1"


def test_summary_files(sweep: Path):
    written = write_sweep_summary(sweep)
    assert set(written) == {"csv", "md", "png"}
    with (sweep / "summary.csv").open() as fh:
        records = list(csv.DictReader(fh))
    assert [r["status"] for r in records] == ["completed", "completed", "interrupted", "failed", "failed"]
    assert records[0]["overrides"] == "experiment=quick sweep=sync_strategies sync=gloo_per_tensor"
    assert float(records[1]["eval_last"]) == pytest.approx(0.5)
    assert records[4]["steps"] == "0" and records[4]["step_s_median"] == "" and "actor_ranks=1" in records[4]["reason"]
    for p in PHASES:
        assert f"{p}_s_median" in records[0]
    md = (sweep / "summary.md").read_text()
    assert md.startswith("# sweep=sync_strategies · quick/2026-11-22_07-00-00\n")
    assert "5 runs: 2 completed, 1 interrupted, 2 failed." in md
    assert "Common overrides: `experiment=quick` `sweep=sync_strategies`" in md
    assert md.count("\n| ") == 6  # header + one line per job
    assert "failed: EngineDiedError: a vLLM engine died while generating" in md
    assert "![" in md and "(summary.png)" in md
    png = (sweep / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_optuna_best_trial_is_marked(tmp_path: Path):
    s = tmp_path / "sweep"
    s.mkdir()
    for i, (lr, kl, slope) in enumerate([(1e-5, 0.01, 0.01), (3.1622776601683795e-4, 0.04, 0.05), (1e-3, 0.07, -0.01)]):
        rows = _curve(4, slope=slope)
        _job(s, i, ["experiment=quick", f"algo.actor_lr={lr}", f"algo.kl_coef={kl}"], rows, _summary(s, rows))
    (s / "optimization_results.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "optuna",
                "best_params": {"algo.actor_lr": 3.1622776601683795e-4, "algo.kl_coef": 0.04},
                "best_value": 0.32,
            }
        )
    )
    # The Optuna sweeper writes no multirun.yaml: the sweep's name comes from a job's .hydra/hydra.yaml.
    (job_dirs(s)[0] / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": {"sweep": "optuna_lr_kl"}}}})
    )
    write_sweep_summary(s, plot=False)
    md = (s / "summary.md").read_text()
    assert md.startswith("# sweep=optuna_lr_kl · ")
    assert "Best trial (job 1)" in md and "| 1 ★ |" in md
    assert "`algo.actor_lr=0.000316,algo.kl_coef=0.04`" in md  # floats shortened in labels only
    assert not (s / "summary.png").exists() and "summary.png" not in md


def test_job_dirs_nested_by_a_slash_and_empty_ones(tmp_path: Path):
    s = tmp_path / "sweep"
    (s / "0_data.train_files=[" / "tmp" / "a.jsonl]" / ".hydra").mkdir(parents=True)
    (s / "1_seed=2").mkdir(parents=True)  # created, then nothing
    (s / ".submitit").mkdir()
    dirs = job_dirs(s)
    assert [d.relative_to(s).as_posix() for d in dirs] == ["0_data.train_files=[/tmp/a.jsonl]", "1_seed=2"]
    assert is_sweep_dir(s) and not is_sweep_dir(dirs[0])
    assert [(r.job, r.status, r.reason) for r in sweep_rows(s)] == [
        ("0", "failed", "no summary.json"),
        ("1", "failed", "no summary.json"),
    ]


def test_objective():
    done = {"status": "completed", "reward_last": 0.4, "eval_last": None}
    assert objective(done) == pytest.approx(0.4)
    assert objective(
        {**done, "eval_last": {"step": 5, "eval/a/mean@4": 0.2, "eval/b/mean@4": 0.6, "eval/a/pass@4": 1.0}}
    ) == pytest.approx(0.4)
    assert eval_score({"step": 5, "eval/a/mean@1": 0.3})[1] == "eval/a/mean@1"
    assert objective({**done, "status": "interrupted"}) is None
    assert objective({**done, "reward_last": math.nan}) is None
    assert objective(None) is None


def test_compare_runs_script(sweep: Path, tmp_path: Path):
    runs = [str(d) for d in job_dirs(sweep)[:2]]
    out = tmp_path / "cmp"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tools" / "compare_runs.py"), *runs, "--out", str(out), "--no-plot"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "summary.csv").exists() and (out / "summary.md").exists()
    assert "sync=gloo_per_tensor" in done.stdout


# --------------------------------------------------------------------------- run.py's job wrapper in a real multirun
TASK = """
import json, sys
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig
from rlhf_orch.reporting.objective import job_result

@hydra.main(config_path=None, config_name=None, version_base="1.3")
def main(cfg):
    def run():  # stands in for rlhf_orch.app.main: (exit code, summary or None)
        out = Path(HydraConfig.get().runtime.output_dir)
        summary = {"status": "completed", "steps": 2, "reward_first": 0.1, "reward_last": 0.25, "eval_last": None}
        if cfg.kind == "config":
            print("error: invalid configuration (1 problem):\\n  - algo.kl_coef=-1: must be >= 0", file=sys.stderr)
            return 2, None
        if cfg.kind == "raise":
            raise RuntimeError("boom")
        if cfg.kind == "signal":
            summary.update(status="interrupted", signal="SIGINT")
        (out / "summary.json").write_text(json.dumps(summary))
        return (130 if cfg.kind == "signal" else 0), summary
    return job_result(run)

main()
"""


def _multirun(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "task.py"
    script.write_text(TASK)
    sweep = tmp_path / "sweep"
    args = [
        sys.executable,
        str(script),
        *overrides,
        f"hydra.sweep.dir={sweep}",
        "+hydra.callbacks.summary._target_=rlhf_orch.reporting.sweep_summary.SweepSummary",
        "+hydra.callbacks.summary.plot=false",
    ]
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120), sweep


def test_failed_jobs_do_not_stop_the_sweep(tmp_path: Path):
    done, sweep = _multirun(tmp_path, "-m", "+kind=ok,config,raise,ok")
    assert done.returncode == 0, done.stderr
    with (sweep / "summary.csv").open() as fh:
        records = list(csv.DictReader(fh))
    assert [(r["job"], r["status"]) for r in records] == [
        ("0", "completed"),
        ("1", "failed"),
        ("2", "failed"),
        ("3", "completed"),
    ]
    assert records[1]["reason"] == "algo.kl_coef=-1: must be >= 0"
    assert records[2]["reason"] == "RuntimeError: boom"
    assert "job 0 objective (reward_last): 0.25" in done.stdout


def test_a_stop_signal_stops_the_sweep_after_its_summary(tmp_path: Path):
    done, sweep = _multirun(tmp_path, "-m", "+kind=ok,signal,ok")
    assert done.returncode == 130, done.stderr
    assert sorted(p.name.split("_")[0] for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]  # job 2 never started
    with (sweep / "summary.csv").open() as fh:
        assert [r["status"] for r in csv.DictReader(fh)] == ["completed", "interrupted"]


def test_a_single_run_exits_with_the_apps_code(tmp_path: Path):
    done, _ = _multirun(tmp_path, "+kind=config", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "must be >= 0" in done.stderr


# --------------------------------------------------------------------------- the committed sweeps
def _sweep_jobs(name: str) -> list[list[str]]:
    """The job overrides of conf/sweep/<name>.yaml (basic sweeper: the product of its value lists)."""
    import itertools

    params = yaml.safe_load((REPO / "conf" / "sweep" / f"{name}.yaml").read_text())["hydra"]["sweeper"]["params"]
    return [
        list(combo)
        for combo in itertools.product(*([f"{k}={v}" for v in str(vals).split(",")] for k, vals in params.items()))
    ]


@pytest.mark.parametrize("name", ["sync_strategies", "transfer_strategies", "kl_coef", "algorithms"])
def test_every_job_of_a_committed_sweep_passes_the_checks(name: str):
    """What `python run.py -m sweep=<name> experiment=quick` runs is valid on this (CPU) machine."""
    from hydra.utils import instantiate

    from rlhf_orch.app import check
    from tests.conftest import compose_config

    for job in _sweep_jobs(name):
        cfg = compose_config([f"sweep={name}", "experiment=quick", *job])
        check(cfg, instantiate(cfg.launcher))  # raises ConfigError / PlacementError on a problem


def test_optuna_sweep_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=["sweep=optuna_lr_kl", "experiment=quick"], return_hydra_config=True
        )
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize" and sweeper.n_trials == 4
    assert set(sweeper.params) == {"algo.actor_lr", "algo.kl_coef"}
    assert cfg.hydra.callbacks.sweep_summary._target_ == "rlhf_orch.reporting.sweep_summary.SweepSummary"
