"""Per-run plots from metrics.jsonl, and the console logger that writes them (no Ray, no training).

The metrics.jsonl here is written the way a run writes it (`MetricsFile`, the keys of a real PPO run:
outputs/<experiment>/<time>/metrics.jsonl), with a slow first step and evaluations at step 0 and
every 10 steps.
"""

from __future__ import annotations

import io
import json
import math
import random

import pytest
from matplotlib.image import imread
from rich.console import Console

from rlhf_orch.logging import console as console_mod
from rlhf_orch.logging.base import MetricsFile
from rlhf_orch.logging.console import ConsoleLogger
from rlhf_orch.logging.base import read_metrics
from rlhf_orch.logging.plots import panels_for, phase_layers, plot_run, smooth

ALL_FILES = {
    "overview.png",
    "reward.png",
    "kl.png",
    "loss.png",
    "response_length.png",
    "step_time.png",
    "throughput.png",
}


def _record(step: int, rng: random.Random) -> dict:
    """One step's metrics, as TrainLoop + the session log them (a PPO run with a reference and a critic)."""
    warm = 5.0 if step == 1 else 0.0  # the first step compiles and fills caches
    t = {
        "generate": 0.25 + warm + rng.uniform(0, 0.05),
        "transfer": 0.14,
        "experience": 0.19,
        "train": 0.28,
        "sync": 0.05,
    }
    step_s = sum(t.values()) - 0.03 + rng.uniform(0, 0.04)  # the transfer clock overlaps the gather
    reward = 0.25 + 0.35 * (1 - math.exp(-step / 20)) + rng.uniform(-0.03, 0.03)
    rec = {
        "step": step,
        "weight_version": step,
        "reward/mean": reward,
        "reward/max": 1.0,
        "reward/solved_frac": 0.05,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "rollout/samples": 128,
        "kl": 0.9 * (1 - math.exp(-step / 30)),
        "loss/policy": rng.uniform(-0.01, 0.01),
        "loss/value": 0.03 * math.exp(-step / 40) + 0.005,
        "values/mean": 0.5,
        "response/mean_len": 4.5 + rng.uniform(-0.3, 0.3),
        "response/max_len": rng.choice([7, 8, 9, 10, 12]),
        "perf/tokens_per_s": 1437 / step_s,
        "perf/gen_tokens_per_s": 560 / t["generate"],
        "time/step": step_s,
        **{f"time/{k}": v for k, v in t.items()},
        "time/transfer_after_generate": t["transfer"],
        "time/hand_over": 0.03,
        "time/reward": 0.004,
        "time/elapsed": 40.0 + step,
        "time/startup": 39.2,
        "share/generate": t["generate"] / step_s,
    }
    if step % 10 == 0:
        rec.update(
            {
                "eval/digit_reverse/mean@1": 0.55 + step / 1000,
                "eval/digit_reverse/pass@1": 0.12,
                "eval/response_mean_len": 3.8,
            }
        )
    return rec


def _write_run(run_dir, steps: int = 60, drop: tuple[str, ...] = (), extra=None) -> None:
    rng = random.Random(0)
    f = MetricsFile(run_dir)
    kept = lambda rec: {k: v for k, v in rec.items() if not any(k == d or k.startswith(d + "/") for d in drop)}  # noqa: E731
    f.write(
        kept({"step": 0, "weight_version": 0, "eval/digit_reverse/mean@1": 0.55, "eval/digit_reverse/pass@1": 0.12})
    )
    for step in range(1, steps + 1):
        rec = kept(_record(step, rng))
        rec.update((extra or {}).get(step, {}))
        f.write(rec)
    f.close()
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 1\nexperiment_name: quick\n")


def _size(path) -> tuple[int, int]:
    return imread(path).shape[:2]  # (height, width) in pixels


def _assert_drawn(path) -> None:
    """A real picture: a few KB at least, and a good share of non-white pixels with several colours."""
    assert path.stat().st_size > 15_000, path
    img = imread(path)[..., :3]
    ink = (img < 0.9).any(axis=-1).mean()
    assert 0.02 < ink < 0.9, (path, ink)
    assert len({tuple(px) for px in (img[::7, ::7].reshape(-1, 3) * 255).round().astype(int).tolist()}) > 20, path


# Steps 5 and 6 have the optional phases: an engine restart (inside generate) and a reward model.
EXTRA = {
    5: {"time/engine_restart": 0.4, "time/generate": 0.7, "time/step": 1.5},
    6: {"time/reward_model": 0.2, "time/step": 1.3},
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A 60-step PPO run with every plotted metric, plotted once for the tests below."""
    run_dir = tmp_path_factory.mktemp("run")
    _write_run(run_dir, extra=EXTRA)
    return run_dir, plot_run(run_dir)


def test_a_full_run_gets_every_plot(full_run):
    run_dir, written = full_run
    assert {p.name for p in written} == ALL_FILES
    assert written[0].name == "overview.png"
    assert {p.name for p in (run_dir / "plots").iterdir()} == ALL_FILES  # no temporary files left
    for path in written:
        _assert_drawn(path)
    h, w = _size(run_dir / "plots" / "kl.png")
    assert w < 1.3 * h * 2  # kl (no loss/kl in a PPO run): one panel, not two
    assert _size(run_dir / "plots" / "loss.png")[1] > 1.8 * w  # policy and value loss side by side


def test_missing_metrics_skip_their_panels_and_files(tmp_path, full_run):
    # A GRPO-like run without a critic or a reference, without throughput or evaluations.
    _write_run(tmp_path, steps=12, drop=("kl", "loss/value", "perf", "eval", "response/max_len"))
    rows = read_metrics(tmp_path)
    files = panels_for(rows)
    assert set(files) == {"reward", "loss", "response_length", "step_time"}
    assert [len(p.lines) for panels in files.values() for p in panels if not p.stacked] == [1, 1, 1]
    written = {p.name for p in plot_run(tmp_path, "grpo_like", tmp_path / "out")}
    assert written == {"overview.png", "reward.png", "loss.png", "response_length.png", "step_time.png"}
    full = full_run[0] / "plots"
    # Four panels (2 x 2) instead of seven (4 x 2): no empty axes are left in the overview.
    assert _size(tmp_path / "out" / "overview.png")[0] < 0.6 * _size(full / "overview.png")[0]
    assert _size(tmp_path / "out" / "loss.png")[1] < 0.6 * _size(full / "loss.png")[1]


def test_no_steps_no_plots(tmp_path):
    assert plot_run(tmp_path) == []  # no metrics.jsonl at all
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/me')  # a line cut by a kill
    assert plot_run(tmp_path) == [] and not (tmp_path / "plots").exists()


def test_step_time_layers_add_up_to_the_step_with_optional_phases(full_run):
    steps, layers, total = phase_layers(read_metrics(full_run[0]))
    assert steps == list(range(1, 61))
    assert list(layers)[:5] == ["generate", "transfer", "experience", "train", "sync"]
    assert {"reward_model", "engine_restart", "other"} <= set(layers)
    for i in range(len(steps)):
        assert sum(layer[i] for layer in layers.values()) == pytest.approx(total[i])
    assert layers["engine_restart"][4] == 0.4 and layers["engine_restart"][0] == 0.0
    assert layers["reward_model"][5] == 0.2


def test_smoothing_keeps_a_warm_up_step_out_of_its_neighbours():
    values = [6.0] + [1.0] * 9
    assert smooth(values, 5, [True] + [False] * 9) == values
    assert smooth(values, 5)[1] > 1.0  # without: the first step leaks into the next ones
    assert smooth([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]


def _logger_run(tmp_path, logger: ConsoleLogger, steps: int = 4) -> None:
    rng = random.Random(1)
    logger.start(str(tmp_path), {"algo": {"num_steps": steps}}, "quick")
    f = MetricsFile(tmp_path)
    for step in range(1, steps + 1):
        rec = _record(step, rng)
        f.write(rec)  # the session writes metrics.jsonl before it calls the logger
        logger.log(step, rec)
    f.close()


def test_console_logger_without_a_terminal_prints_step_lines_and_plots(tmp_path, monkeypatch, capsys):
    calls = []  # plot_run itself is tested above: here, when the logger calls it, and what it says

    def fake_plot_run(run_dir, name):
        calls.append((run_dir, name, len(read_metrics(run_dir))))
        return [tmp_path / "plots" / "overview.png", tmp_path / "plots" / "reward.png"]

    monkeypatch.setattr("rlhf_orch.logging.plots.plot_run", fake_plot_run)
    logger = ConsoleLogger(plot_every_n_steps=3)
    _logger_run(tmp_path, logger)
    assert calls == [(str(tmp_path), "quick", 3)]  # refreshed at step 3, from the metrics written so far
    logger.close()
    logger.close()  # idempotent: the session and a subclass may both close
    out = capsys.readouterr().out
    assert not logger.interactive  # pytest captures stdout: no progress bar
    assert [line.split("|")[0].strip() for line in out.splitlines() if line.startswith("step")] == [
        f"step    {i}/4" for i in range(1, 5)
    ]
    assert "\x1b[" not in out  # no cursor movement or colour codes in a log file
    assert calls[1:] == [(str(tmp_path), "quick", 4)]  # and once at the end
    assert out.count(f"plots: {tmp_path}/plots/ (overview.png, reward.png)") == 1


def test_a_plot_failure_is_one_line_never_a_failed_run(tmp_path, monkeypatch, capsys):
    import rlhf_orch.logging.plots as plots

    monkeypatch.setattr(plots, "plot_run", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    logger = ConsoleLogger(plot_every_n_steps=1)
    _logger_run(tmp_path, logger, steps=2)
    logger.close(exit_code=1)
    out = capsys.readouterr().out
    assert out.count("plots: not written (OSError: disk full)") == 3  # steps 1, 2 and the end


def test_console_logger_in_a_terminal_shows_a_progress_bar(tmp_path, monkeypatch):
    monkeypatch.setattr(console_mod, "is_interactive", lambda stream=None: True)
    logger = ConsoleLogger()
    buf = io.StringIO()
    logger.console = Console(file=buf, force_terminal=True, width=140, highlight=False)
    monkeypatch.setattr(ConsoleLogger, "plot", lambda self: [])
    rng = random.Random(2)
    logger.start(str(tmp_path), {"algo": {"num_steps": 20}}, "quick")
    logger.log(1, _record(1, rng))
    logger.log(10, _record(10, rng))  # an evaluation step: its results are printed above the bar
    logger._progress.refresh()
    logger.close()
    out = buf.getvalue()
    assert "training" in out and "10/20" in out and "ETA" in out
    assert "reward 0." in out and "kl 0." in out
    assert "eval digit_reverse mean@1 0.560 pass@1 0.120" in out
    assert "gen " not in out  # the per-step timing line is left to verbose=True and to non-terminals


def test_negative_plot_interval_is_refused():
    with pytest.raises(ValueError, match="logger.plot_every_n_steps=-1"):
        ConsoleLogger(plot_every_n_steps=-1)


def test_metrics_rows_of_a_real_run_shape_are_read_back(tmp_path):
    _write_run(tmp_path, steps=3)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])["time/step"] > 5  # the warm-up step


# --------------------------------------------------------------------------- library output
def test_ray_driver_messages_go_to_the_run_dir_and_errors_to_the_console(tmp_path):
    import logging

    import ray  # noqa: F401 - Ray's own console handler is on the "ray" logger, as in a run

    from rlhf_orch.logging.console import LibraryOutput

    ray_logger = logging.getLogger("ray")
    console = io.StringIO()
    handler = logging.StreamHandler(console)  # stands for Ray's console handler (it holds the stderr of its time)
    ray_logger.addHandler(handler)
    output = LibraryOutput(tmp_path)
    assert output.init_kwargs() == {"log_to_driver": False}
    try:
        output.start()
        try:
            ray_logger.info("Started a local Ray instance.")
            logging.getLogger("ray._private.authentication").warning(
                "Token authentication is enabled for this Ray cluster."
            )
            ray_logger.error("the GCS went away")
        finally:
            output.finish()
        assert console.getvalue() == "the GCS went away\n"  # errors still reach the console, nothing else
        log = (tmp_path / "ray_workers.log").read_text()
        assert "Started a local Ray instance." in log and "Token authentication is enabled" in log
        ray_logger.info("after the session")  # the handlers are back as they were
        assert (
            "after the session" in console.getvalue()
            and "after the session" not in (tmp_path / "ray_workers.log").read_text()
        )
    finally:
        ray_logger.removeHandler(handler)


def test_the_raylet_s_notices_about_dead_workers_go_to_the_run_dir_not_the_console(tmp_path, capsys):
    """Ray's driver prints what the raylet publishes (a worker died or was killed) straight to
    stdout, coloured and several lines long per fault; the run says it in one line of its own."""
    from ray._private import worker as ray_worker

    from rlhf_orch.logging.console import LibraryOutput

    notice = {
        "lines": ["\x1b[33mA worker died or was killed while executing a task by an unexpected system error.\x1b[0m"],
        "pid": "raylet",
        "is_err": False,
    }
    output = LibraryOutput(tmp_path)
    output.start()
    try:
        ray_worker.print_to_stdstream(notice, ignore_prefix=False)
        ray_worker.print_to_stdstream(
            {"lines": ["an actor's own line"], "pid": 1234, "is_err": False}, ignore_prefix=True
        )
        oom = {"lines": ["Task was killed due to the node running low on memory."], "pid": "raylet", "is_err": False}
        ray_worker.print_to_stdstream(oom, ignore_prefix=False)
    finally:
        output.finish()
    out = capsys.readouterr().out
    assert "A worker died" not in out and "an actor's own line" in out  # (log_to_driver=false never sends those)
    assert "running low on memory" in out  # the raylet's other notices say why: they stay
    log = (tmp_path / "ray_workers.log").read_text()
    assert (
        "(raylet) A worker died or was killed while executing a task by an unexpected system error." in log
        and "\x1b" not in log
    )
    ray_worker.print_to_stdstream(notice, ignore_prefix=False)  # Ray's own printer is back
    assert "A worker died" in capsys.readouterr().out


def test_verbose_leaves_ray_output_on_the_console(tmp_path):
    from rlhf_orch.logging.console import LibraryOutput

    output = LibraryOutput(tmp_path, verbose=True)
    assert output.init_kwargs() == {"log_to_driver": True}
    output.start()
    output.connected()
    output.finish()
    assert not (tmp_path / "ray_workers.log").exists()


def test_worker_output_is_copied_per_actor_without_ray_markers(tmp_path):
    from rlhf_orch.logging.console import collect_worker_logs

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-aa11-01000000-12.err").write_text(
        ":job_id:01000000\n:actor_name:VLLMEngine\nTriton is installed, but doesn't include CPU backend.\n"
        "Loading safetensors checkpoint shards:   0% Completed | 0/1\rLoading safetensors checkpoint shards: 100% Completed | 1/1\n"
    )
    (logs / "worker-bb22-01000000-7.out").write_text(":job_id:01000000\n:actor_name:PolicyWorker\n")  # silent
    (logs / "worker-cc33-02000000-9.err").write_text(":job_id:02000000\n:actor_name:Other\nnot this job\n")
    (logs / "worker-dd44-01000000-5.err").write_text(
        ":job_id:01000000\n:actor_name:PolicyWorker\n[WARNING] Setting accelerator to CPU.\n"
    )
    dest = tmp_path / "ray_workers.log"
    dest.write_text("driver line\n")
    assert collect_worker_logs(logs, dest, "01000000") == 2
    assert dest.read_text().splitlines() == [
        "driver line",
        "==== PolicyWorker pid=5 (stderr) ====",
        "[WARNING] Setting accelerator to CPU.",
        "==== VLLMEngine pid=12 (stderr) ====",
        "Triton is installed, but doesn't include CPU backend.",
        "Loading safetensors checkpoint shards:   0% Completed | 0/1",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1",
    ]
