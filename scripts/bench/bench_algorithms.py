"""Every `algo` option on the default task, the same seed and steps: learning and step time side by side.

    python scripts/bench/bench_algorithms.py                     # 100 steps each (~10-15 min on 2 cores)
    python scripts/bench/bench_algorithms.py --steps 30 --algos ppo grpo

Runs `python run.py algo=<name> algo.num_steps=<steps>` one after another (one heavy job at a time),
reads each run's metrics.jsonl and prints a table, then one JSON line with, per algorithm, the mean
reward of the first and last five steps, the median step time and its ratio to PPO's (measured in
this same invocation, so the ratio is fair on a shared machine), and the median train time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from rlhf_orch.logging.base import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT = ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo"]


def run(algo: str, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / algo
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "run.py", f"algo={algo}", f"algo.num_steps={steps}", f"hydra.run.dir={run_dir}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {
            "algo": algo,
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
        }
    rows = read_metrics(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards))
    steady = rows[1:] or rows  # step 1 includes the engines' warm-up
    return {
        "algo": algo,
        "steps": len(rows),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "median_step_s": statistics.median(r["time/step"] for r in steady),
        "median_train_s": statistics.median(r["time/train"] for r in steady),
        "median_experience_s": statistics.median(r["time/experience"] for r in steady),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--algos", nargs="+", default=DEFAULT)
    parser.add_argument("overrides", nargs="*", help="extra run.py overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_algorithms_") as tmp:
        results = [run(a, args.steps, Path(tmp), args.overrides) for a in args.algos]
    ppo = next((r for r in results if r["algo"] == "ppo" and "error" not in r), None)
    print(
        f"{'algo':<22} {'reward first':>12} {'reward last':>12} {'step (med)':>11} {'vs ppo':>7} {'train':>7} {'experience':>10}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['algo']:<22} error: {r['error']}")
            continue
        r["step_vs_ppo"] = r["median_step_s"] / ppo["median_step_s"] if ppo else None
        ratio = f"{r['step_vs_ppo']:.2f}" if r["step_vs_ppo"] else "-"
        print(
            f"{r['algo']:<22} {r['reward_first']:>12.3f} {r['reward_last']:>12.3f} {r['median_step_s']:>10.3f}s "
            f"{ratio:>7} {r['median_train_s']:>6.3f}s {r['median_experience_s']:>9.3f}s"
        )
    print(json.dumps({"steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
