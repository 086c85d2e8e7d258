"""LoRA against full fine-tuning, side by side in one run of this script: what a sync moves and costs,
step time, the policy process's memory, and learning.

Three runs of `run.py` with the same seed and settings: full fine-tuning, `model.lora.rank=R` with the
adapter synced (`model.lora.sync=adapter`: vLLM serves it), and the same with merged weights pushed
(`model.lora.sync=merged`). Each run's process tree is polled for its RSS high-water marks (the policy
actor's, from `scripts/bench_memory.py`'s poller). Per run: median `sync/bytes_per_engine`, `time/sync`,
`time/step` and its phases over the steps after the first, the policy's peak RSS, and the reward curve
(and the held-out score where the recipe evaluates). Ratios are taken within this script's runs.

    .venv/bin/python scripts/bench/bench_lora.py                       # tiny model, the default task (100 steps each, ~4 min)
    .venv/bin/python scripts/bench/bench_lora.py --model smollm2_135m  # SmolLM2 on experiment=smollm2_arith (~35 min)
    .venv/bin/python scripts/bench/bench_lora.py --model smollm2_135m --steps 3 --variants full,adapter   # sync/step figures only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_memory import run_polled
from rlhf_orch.logging.base import read_metrics

# Per model: the recipe each variant runs, and the LoRA learning rate (adapters need a larger step than
# full fine-tuning; the tiny model's default actor_lr serves both).
RECIPES = {
    "tiny": {"base": [], "lora_extra": []},
    "smollm2_135m": {"base": ["experiment=smollm2_arith"], "lora_extra": ["algo.actor_lr=3e-4"]},
}
PHASES = ("generate", "experience", "train", "sync")


def variants(rank: int, model: str) -> dict[str, list[str]]:
    lora = [f"model.lora.rank={rank}", *RECIPES[model]["lora_extra"]]
    return {"full": [], "adapter": [*lora, "model.lora.sync=adapter"], "merged": [*lora, "model.lora.sync=merged"]}


def run(overrides: list[str], run_dir: Path, reuse: bool = False) -> dict:
    summary = run_dir / "summary.json"
    if reuse and summary.is_file() and json.loads(summary.read_text()).get("status") == "completed":
        out, peak = (run_dir / "run.log").read_text(), None  # an earlier run of this variant: no memory figure
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run dir's metrics.jsonl is appended to, not replaced
        poller, returncode, out = run_polled(overrides, run_dir)
        if returncode != 0:
            raise SystemExit(f"run failed ({returncode}): {' '.join(overrides)}")
        peak = poller.by_role().get("actor0", 0) / 1e9
    logged = read_metrics(run_dir)
    rows = [r for r in logged if "reward/mean" in r]  # (a step-0 row holds the evaluation before training)
    later = rows[1:] or rows  # the first step pays one-time costs (first sync, kernel warm-up)
    med = lambda key: statistics.median(r[key] for r in later if key in r)  # noqa: E731
    evals = [(r["step"], v) for r in logged for k, v in r.items() if k.startswith("eval/") and k.endswith("mean@4")]
    lora_line = next((line for line in out.splitlines() if line.startswith("lora:")), "")
    return {
        "overrides": overrides,
        "steps": len(rows),
        "bytes_per_sync": med("sync/bytes_per_engine"),
        "sync_s": med("time/sync"),
        "step_s": med("time/step"),
        **{f"{p}_s": med(f"time/{p}") for p in PHASES},
        "policy_peak_gb": peak,
        "wall_s": json.loads(summary.read_text()).get("wall_s"),
        "reward": [r["reward/mean"] for r in rows],
        "eval": evals,
        "lora_line": lora_line,
    }


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_eval = any(r["eval"] for r in results.values())
    window = 1
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(11 if has_eval else 6, 4), squeeze=False)
    for name, r in results.items():
        window = max(1, len(r["reward"]) // 10)
        smooth = [statistics.mean(r["reward"][max(0, i - window + 1) : i + 1]) for i in range(len(r["reward"]))]
        # merged and adapter serve the same policy: the same curve, drawn dashed over the other
        style = {"linestyle": "--"} if name == "merged" else {}
        axes[0][0].plot(range(1, len(smooth) + 1), smooth, label=name, **style)
        if has_eval and r["eval"]:
            axes[0][1].plot(*zip(*r["eval"]), marker="o", label=name, **style)
    axes[0][0].set(
        xlabel="step",
        ylabel=f"training reward (mean of the last {window} steps)" if window > 1 else "training reward",
        title=title,
    )
    axes[0][0].legend()
    if has_eval:
        axes[0][1].set(xlabel="step", ylabel="held-out mean@4", title="held-out score")
        axes[0][1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(RECIPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=None, help="algo.num_steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", default="full,adapter,merged")
    parser.add_argument(
        "--reuse", action="store_true", help="take a variant's completed run in --work-dir instead of running it again"
    )
    parser.add_argument(
        "--work-dir",
        default=os.environ.get("RLHF_ORCH_BENCH_DIR", str(Path(tempfile.gettempdir()) / "rlhf_orch_bench_lora")),
    )
    args = parser.parse_args()
    work = Path(args.work_dir) / args.model
    base = [
        *([] if args.model == "tiny" else [f"model={args.model}"]),
        *RECIPES[args.model]["base"],
        f"seed={args.seed}",
    ]
    if args.steps:
        base.append(f"algo.num_steps={args.steps}")
    chosen = {k: v for k, v in variants(args.rank, args.model).items() if k in args.variants.split(",")}
    results = {}
    for name, extra in chosen.items():
        print(f"running {name}: {' '.join(base + extra)}", flush=True)
        results[name] = run(base + extra, work / name, args.reuse)
        if results[name]["lora_line"]:
            print("  " + results[name]["lora_line"], flush=True)
    header = f"{'variant':8s} {'bytes/sync':>12s} {'sync s':>8s} {'step s':>8s} " + " ".join(
        f"{p + ' s':>11s}" for p in PHASES
    )
    print("\n" + header + f" {'policy GB':>10s} {'reward first5 -> last5':>24s}")
    for name, r in results.items():
        rw = r["reward"]
        first, last = statistics.mean(rw[:5]), statistics.mean(rw[-5:])
        peak = f"{r['policy_peak_gb']:10.2f}" if r["policy_peak_gb"] is not None else f"{'-':>10s}"
        print(
            f"{name:8s} {r['bytes_per_sync'] / 1e6:10.2f}MB {r['sync_s']:8.3f} {r['step_s']:8.2f} "
            + " ".join(f"{r[p + '_s']:11.3f}" for p in PHASES)
            + f" {peak} {first:10.3f} -> {last:.3f}"
            + (f"   held-out {r['eval'][0][1]:.3f} -> {r['eval'][-1][1]:.3f}" if r["eval"] else "")
        )
    plot_path = work / "reward_curves.png"
    plot(results, plot_path, f"{args.model}: full vs LoRA rank {args.rank}")
    print(f"plot: {plot_path}")
    out = {
        "benchmark": "lora",
        "model": args.model,
        "rank": args.rank,
        "seed": args.seed,
        **{name: {k: v for k, v in r.items() if k not in ("lora_line",)} for name, r in results.items()},
    }
    if "full" in results and "adapter" in results:
        full, adapter = results["full"], results["adapter"]
        out.update(
            {
                "bytes_ratio_full_over_adapter": round(full["bytes_per_sync"] / adapter["bytes_per_sync"], 2),
                "goal_bytes_ratio": 25 if args.model == "smollm2_135m" else None,
                "sync_time_ratio_full_over_adapter": round(full["sync_s"] / adapter["sync_s"], 2),
                "step_time_ratio_adapter_over_full": round(adapter["step_s"] / full["step_s"], 3),
                "policy_memory_ratio_adapter_over_full": (
                    round(adapter["policy_peak_gb"] / full["policy_peak_gb"], 3)
                    if full["policy_peak_gb"] and adapter["policy_peak_gb"]
                    else None
                ),
            }
        )
    if "merged" in results and "adapter" in results:
        out["sync_time_ratio_merged_over_adapter"] = round(
            results["merged"]["sync_s"] / results["adapter"]["sync_s"], 2
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
