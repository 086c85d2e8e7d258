"""Summarise a run's metrics.jsonl: reward trajectory and the per-step time breakdown.

    python scripts/tools/summarize_run.py outputs/default/<timestamp>

Prints a table (median seconds per phase, share of the step) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from rlhf_orch.logging.base import read_metrics

PHASES = ("generate", "reward", "transfer", "experience", "train", "sync")


def summarize(run_dir: Path, window: int = 5) -> dict:
    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no steps")
    steady = rows[1:] or rows  # step 1 includes engine warm-up (first generate compiles/allocates)
    step_median = statistics.median(r["time/step"] for r in steady)
    phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steady) for p in PHASES}
    k = max(1, min(window, len(rows) // 3))
    return {
        "run_dir": str(run_dir),
        "steps": len(rows),
        "reward_first": statistics.fmean(r["reward/mean"] for r in rows[:k]),
        "reward_last": statistics.fmean(r["reward/mean"] for r in rows[-k:]),
        "step_s_median": step_median,
        "first_step_s": rows[0]["time/step"],
        "startup_s": rows[0].get("time/startup"),
        "phases_s_median": phases,
        "tokens_per_s_median": statistics.median(r["perf/tokens_per_s"] for r in steady),
        "wall_s": rows[-1].get("time/elapsed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--window", type=int, default=5, help="steps averaged for first/last reward")
    args = parser.parse_args()
    s = summarize(args.run_dir, args.window)
    print(f"run {s['run_dir']}: {s['steps']} steps, reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}")
    print(f"startup {s['startup_s']:.1f}s, first step {s['first_step_s']:.2f}s, wall {s['wall_s']:.1f}s")
    print(f"{'phase':<12}{'median s':>10}{'share':>8}")
    for phase, sec in s["phases_s_median"].items():
        print(f"{phase:<12}{sec:>10.3f}{sec / s['step_s_median']:>8.1%}")
    print(f"{'step':<12}{s['step_s_median']:>10.3f}{1:>8.0%}")
    print(json.dumps(s))


if __name__ == "__main__":
    main()
