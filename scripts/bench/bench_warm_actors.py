"""What `launcher.keep_actors=true` saves: runs one after another in one process and one Ray session,
each on new actors (the baseline: `keep_actors=false`) and on the actors the run before kept.

    python scripts/bench/bench_warm_actors.py                  # experiment=quick (PPO: 4 processes), 3 runs each
    python scripts/bench/bench_warm_actors.py --runs 4 --overrides algo=grpo algo.kl_placement=off

Per run: wall seconds from `run_training` to its summary, and the machine's busy CPU-seconds over
that time (/proc/stat: every process, the actors' included -- what a run costs the machine, which
on a 2-core box is what the test suite pays). The first kept-actors run starts new actors (nothing
is kept yet) and is reported apart. Also checks that every run logged the same metrics (clocks
aside): the kept actors' runs must equal the new ones' bit for bit. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hydra.utils import instantiate

from launchers.local import LocalRayLauncher
from rlhf_orch.app import check
from rlhf_orch.orchestration import warm_actors
from rlhf_orch.orchestration.session import run_training
from tests.conftest import compose_config
from tests.e2e.test_resume import _comparable
from rlhf_orch.logging.base import read_metrics


def busy_cpu_seconds() -> float:
    """CPU-seconds every core of the machine spent busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100  # minus idle and iowait (USER_HZ = 100)


def one_run(overrides: list[str], keep: bool, work: Path) -> dict:
    cfg = compose_config(
        [
            *overrides,
            "checkpoint.export_final=false",
            "launcher.reuse_session=true",
            f"launcher.keep_actors={str(keep).lower()}",
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    run_dir = work / f"run_{time.monotonic_ns()}"
    cpu0, t0 = busy_cpu_seconds(), time.perf_counter()
    summary = run_training(cfg, typed, plan, launcher, run_dir)
    wall, cpu = time.perf_counter() - t0, busy_cpu_seconds() - cpu0
    assert summary["status"] == "completed", summary
    metrics = read_metrics(run_dir)
    return {"wall_s": wall, "cpu_s": cpu, "metrics": _comparable(metrics)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--overrides", nargs="*", default=["experiment=quick", "algo.num_steps=2"])
    args = parser.parse_args()

    with LocalRayLauncher(logical_gpus=8, reuse_session=True).session():
        pass  # one Ray session for every run (reuse_session), as the test suite and a sweep have
    with tempfile.TemporaryDirectory() as tmp:
        new = [one_run(args.overrides, False, Path(tmp)) for _ in range(args.runs)]
        kept = [one_run(args.overrides, True, Path(tmp)) for _ in range(args.runs + 1)]
        warm_actors.release()
    first_kept, kept = kept[0], kept[1:]
    same = all(r["metrics"] == new[0]["metrics"] for r in [*new, first_kept, *kept])

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"{'mode':<34} {'runs':>4} {'wall s':>8} {'busy CPU-s':>11}")
    print(f"{'new actors (keep_actors=false)':<34} {len(new):>4} {med(new, 'wall_s'):>8.1f} {med(new, 'cpu_s'):>11.1f}")
    print(f"{'first run, keep_actors=true':<34} {1:>4} {first_kept['wall_s']:>8.1f} {first_kept['cpu_s']:>11.1f}")
    print(
        f"{'kept actors (keep_actors=true)':<34} {len(kept):>4} {med(kept, 'wall_s'):>8.1f} {med(kept, 'cpu_s'):>11.1f}"
    )
    print(f"metrics of every run equal (clocks aside): {same}")
    print(
        json.dumps(
            {
                "bench": "warm_actors",
                "overrides": args.overrides,
                "runs": args.runs,
                "baseline_wall_s": round(med(new, "wall_s"), 2),
                "baseline_cpu_s": round(med(new, "cpu_s"), 1),
                "kept_wall_s": round(med(kept, "wall_s"), 2),
                "kept_cpu_s": round(med(kept, "cpu_s"), 1),
                "wall_ratio": round(med(new, "wall_s") / med(kept, "wall_s"), 1),
                "cpu_ratio": round(med(new, "cpu_s") / med(kept, "cpu_s"), 1),
                "metrics_equal": same,
            }
        )
    )


if __name__ == "__main__":
    main()
