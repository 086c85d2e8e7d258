"""Committed reproductions: every experiment composes, plans its published cluster, runs scaled, reports.

`scripts/reproduce.py <name> --scale cpu` on two runnable committed experiments (END_TO_END, 2 steps,
the systems studies skipped; the full tier), every runnable one planned at its published scale and
at this machine's, plus the pure pieces: references
that cannot be used are refused at load time, scaling keeps the shape and says what it reduced,
verdicts follow tolerances.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_orch.reproduce.reference import ReferenceError, load_reference
from rlhf_orch.reproduce.report import NOT_MEASURED, OUTSIDE, WITHIN, compare, measured_value

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "tools"))
import reproduce  # noqa: E402


def _declared() -> dict[str, bool]:
    """Each experiment with a `reference:` block -> its `runnable`, read from the YAML file: what
    collection needs for the parametrize lists. (Composing all 14 experiments at import cost every
    xdist worker ~6 s of its collection; `test_list_...` holds this reading equal to the composed
    references.)"""
    import yaml

    out = {}
    for name in reproduce.experiments():
        block = (yaml.safe_load((REPO / "conf" / "experiment" / f"{name}.yaml").read_text()) or {}).get("reference")
        if block:
            out[name] = bool(block.get("runnable", True))
    return out


DECLARED = _declared()
RUNNABLE = sorted(n for n, runnable in DECLARED.items() if runnable)


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    return reproduce.reference_of(name)


def _references() -> dict:
    out = {}
    for name in reproduce.experiments():
        try:
            out[name] = _reference(name)
        except ReferenceError:
            pass
    return out


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # The command as docs name it: scripts/reproduce.py, the entry point that runs scripts/tools/reproduce.py.
    return subprocess.run(
        [sys.executable, "scripts/reproduce.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


# The command's answers without a run, in-process (its main, as `python scripts/reproduce.py` calls
# it); the scaled end-to-end runs below go through the command line itself.
def test_list_shows_at_least_seven_experiments_with_their_numbers(capsys):
    assert reproduce.main(["--list"]) == 0
    out = capsys.readouterr().out
    references = _references()
    assert len(references) >= 7
    for name in references:
        assert name in out
    # the YAML reading the parametrize lists come from is the composed one
    assert DECLARED == {name: ref.runnable for name, ref in references.items()}


def test_unknown_experiment_lists_the_known_ones(capsys):
    assert reproduce.main(["no_such_run"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'no_such_run'" in err and RUNNABLE[0] in err


def test_matching_hardware_is_required_without_scale(capsys):
    assert reproduce.main([RUNNABLE[0]]) == 2
    assert "--scale cpu" in capsys.readouterr().err


def test_a_reference_whose_metric_no_run_logs_is_refused_naming_both():
    block = {
        "title": "t",
        "numbers": [{"name": "acc", "value": 0.5, "unit": "fraction", "measures": "x", "metric": "val/acc"}],
    }
    with pytest.raises(ReferenceError, match="experiment=demo.*acc.*'val/acc'.*no run logs"):
        load_reference("demo", block)
    load_reference("demo", {**block, "numbers": [{**block["numbers"][0], "metric": "eval/openai/gsm8k/mean@1"}]})


def test_verdicts_follow_tolerance_and_direction():
    ref = load_reference(
        "demo",
        {
            "numbers": [
                {
                    "name": "a",
                    "value": 0.5,
                    "unit": "fraction",
                    "measures": "x",
                    "metric": "reward/mean",
                    "at_step": 2,
                    "tolerance": 0.05,
                },
                {
                    "name": "b",
                    "value": 0.4,
                    "unit": "fraction",
                    "measures": "x",
                    "metric": "share/sync",
                    "comparison": "at_least",
                    "tolerance": 0.05,
                },
                {"name": "c", "value": 1.0, "unit": "s", "measures": "x", "metric": None},
            ]
        },
    )
    rows = [
        {"step": 1, "reward/mean": 0.1, "share/sync": 0.3},
        {"step": 2, "reward/mean": 0.53, "share/sync": 0.5},
        {"step": 3, "reward/mean": 0.9, "share/sync": 0.45},
    ]
    assert measured_value(rows, "reward/mean", 2) == 0.53
    assert measured_value(rows, "share/sync", None) == pytest.approx(0.475)  # median after the warm-up step
    verdicts = [c.verdict for c in compare(ref, rows, comparable=True)]
    assert verdicts == [WITHIN, WITHIN, NOT_MEASURED]
    rows[1]["reward/mean"] = 0.6
    assert compare(ref, rows, comparable=True)[0].verdict == OUTSIDE
    rows[1]["share/sync"] = rows[2]["share/sync"] = 0.34  # below the bound minus its tolerance
    assert compare(ref, rows, comparable=True)[1].verdict == OUTSIDE
    assert all(c.verdict == NOT_MEASURED for c in compare(ref, rows, comparable=False, why_not="scaled"))


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_every_experiment_plans_its_published_cluster_and_scales_to_this_machine(name, tmp_path):
    from rlhf_orch.reproduce.scaling import scale_to_cpu

    ref = _reference(name)
    if not ref.runnable:
        assert ref.why_not_runnable, f"{name}: a reference-only entry must say why"
        return
    plan = reproduce.published_plan(name)
    assert "placement:" in plan
    published = reproduce.compose_experiment(name)
    scaled = scale_to_cpu(published, 2, {"train": "x.parquet", "test": "y.parquet"})
    assert any(r.startswith("placement") for r in scaled.reductions) and any("model" in r for r in scaled.reductions)
    # The scaled config composes and passes every check a run makes before Ray starts, here.
    from hydra.utils import instantiate

    from rlhf_orch.app import check

    cfg = reproduce.compose_experiment(name, scaled.overrides)
    _, plan = check(cfg, instantiate(cfg.launcher))
    assert plan.total_gpus <= 3


# Two steps scaled, end to end, for the two experiments whose shapes no other end-to-end test has:
# DAPO (dynamic sampling, overlong shaping, no reference) and split with a reward-model role. Colocated
# PPO with a critic (test_ppo_run, the full tier) and GRPO (test_learning) run end to end elsewhere, and the report code
# is the same for every experiment; each experiment passes every pre-Ray check scaled (the test above).
# Both are in the full tier (`make test-full`), for CI's time: CI plans every experiment at scale
# (the test above) and runs a reward-model role end to end in test_own_data_and_reward.
END_TO_END = [n for n in ("dapo_qwen25_math_7b", "openrlhf_ppo_llama3_8b") if n in RUNNABLE]


# slow (~45-80 s each): `scripts/reproduce.py` as a user runs it, a CLI process with its own Ray.
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.own_processes
@pytest.mark.extended
@pytest.mark.parametrize("name", END_TO_END)
def test_scaled_run_writes_a_report(name, tmp_path):
    proc = _cli(name, "--scale", "cpu", "--steps", "2", "--skip-studies", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    report = (tmp_path / "report.md").read_text()
    for section in (
        "## Published numbers and this run",
        "## The plan the published cluster gets",
        "## Scaled to this machine",
        "## Exact config differences",
    ):
        assert section in report, section
    assert (tmp_path / "plots" / "reward.png").exists() and (tmp_path / "plots" / "step_time.png").exists()
