"""What `placement.reference_in_actor` saves: the KL reference inside the policy rank's process
(the default where the plan allows it) against a reference process of its own (the baseline:
`placement.reference_in_actor=false`), each run on new actors in one Ray session, alternating.

    python scripts/bench/bench_reference_in_actor.py                      # experiment=quick (PPO), 3 runs each
    python scripts/bench/bench_reference_in_actor.py --overrides algo=grpo algo.num_steps=5

Per run: start-up (from `run_training` to the end of the first step), wall seconds to the summary,
the machine's busy CPU-seconds over the run (/proc/stat: every process, the actors' included), the
peak of the summed resident memory of Ray's worker processes (`ray::` in their command line;
sampled every 0.1 s) and the per-step time after the first step. Checks that both modes log the
same metrics (clocks aside). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hydra.utils import instantiate

from launchers.local import LocalRayLauncher
from rlhf_orch.app import check
from rlhf_orch.logging.base import read_metrics
from rlhf_orch.orchestration.session import run_training
from scripts.bench.bench_warm_actors import busy_cpu_seconds
from tests.conftest import compose_config
from tests.e2e.test_resume import _comparable

MODES = {"own process (baseline)": "false", "inside the actor": "null"}


def ray_workers_rss() -> int:
    """Summed resident bytes of the processes whose command line names a Ray actor (`ray::`)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "cmdline").read_bytes().startswith(b"ray::"):
                total += int((proc / "statm").read_text().split()[1]) * 4096
        except OSError:
            continue
    return total


class PeakSampler:
    def __init__(self, interval_s: float = 0.1):
        self.peak, self._stop, self._interval = 0, threading.Event(), interval_s
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, ray_workers_rss())
            time.sleep(self._interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def one_run(overrides: list[str], reference_in_actor: str, work: Path) -> dict:
    cfg = compose_config(
        [
            *overrides,
            "checkpoint.export_final=false",
            "launcher.reuse_session=true",
            "launcher.keep_actors=false",
            f"placement.reference_in_actor={reference_in_actor}",
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    assert plan.reference_in_actor == (reference_in_actor == "null"), "the plan does not host the reference"
    run_dir = work / f"run_{time.monotonic_ns()}"
    first_step: list[float] = []
    cpu0, t0 = busy_cpu_seconds(), time.perf_counter()
    with PeakSampler() as memory:
        summary = run_training(
            cfg,
            typed,
            plan,
            launcher,
            run_dir,
            callbacks=[lambda step, loop: first_step.append(time.perf_counter()) if step == 1 else None],
        )
    wall, cpu = time.perf_counter() - t0, busy_cpu_seconds() - cpu0
    assert summary["status"] == "completed", summary
    rows = read_metrics(run_dir)
    later = [r["time/step"] for r in rows[1:]]
    return {
        "startup_s": first_step[0] - t0,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_gb": memory.peak / 1e9,
        "step_s": statistics.median(later) if later else float("nan"),
        "metrics": _comparable(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--overrides", nargs="*", default=["experiment=quick", "algo.num_steps=4"])
    args = parser.parse_args()

    with LocalRayLauncher(logical_gpus=8, reuse_session=True).session():
        pass  # one Ray session for every run (reuse_session)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):  # alternating, so that the machine's drift falls on both
            for mode, value in MODES.items():
                results[mode].append(one_run(args.overrides, value, Path(tmp)))
    every = [r for rows in results.values() for r in rows]
    same = all(r["metrics"] == every[0]["metrics"] for r in every)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    keys = [
        ("startup_s", "start-up s"),
        ("wall_s", "wall s"),
        ("cpu_s", "busy CPU-s"),
        ("peak_gb", "peak GB"),
        ("step_s", "s/step"),
    ]
    print(f"{'reference':<24} {'runs':>4} " + " ".join(f"{label:>11}" for _, label in keys))
    for mode in MODES:
        print(f"{mode:<24} {len(results[mode]):>4} " + " ".join(f"{med(mode, k):>11.2f}" for k, _ in keys))
    print(f"metrics of every run equal (clocks aside): {same}")
    base, hosted = MODES
    print(
        json.dumps(
            {
                "bench": "reference_in_actor",
                "overrides": args.overrides,
                "runs": args.runs,
                **{f"baseline_{k}": round(med(base, k), 2) for k, _ in keys},
                **{f"hosted_{k}": round(med(hosted, k), 2) for k, _ in keys},
                "cpu_saved_s": round(med(base, "cpu_s") - med(hosted, "cpu_s"), 1),
                "peak_saved_gb": round(med(base, "peak_gb") - med(hosted, "peak_gb"), 2),
                "metrics_equal": same,
            }
        )
    )


if __name__ == "__main__":
    main()
