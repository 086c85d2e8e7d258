"""PNG plots of one run from its metrics.jsonl: reward (and eval) curve, and the step-time breakdown.

Readable at a glance: labelled axes with units, the run's name in the title, a smoothed line with
the raw values faint behind it. Used by `scripts/reproduce.py` reports (and any run dir).
"""

from __future__ import annotations

import json
from pathlib import Path

PHASES = ("generate", "transfer", "experience", "train", "sync")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_run(run_dir: str | Path, name: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write reward.png and step_time.png (when the run has steps); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) >= 1 and "reward/mean" in r]
    out = Path(out_dir or Path(run_dir) / "plots")
    out.mkdir(parents=True, exist_ok=True)
    if not rows:
        return []
    written = []
    steps = [r["step"] for r in rows]
    rewards = [r["reward/mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="tab:blue", alpha=0.25, linewidth=1, label="reward/mean (per step)")
    ax.plot(steps, _smooth(rewards, max(1, len(rewards) // 20)), color="tab:blue", linewidth=2, label="reward/mean (smoothed)")
    evals = [(r["step"], k, v) for r in read_metrics(run_dir) for k, v in r.items() if k.startswith("eval/") and "/mean@" in k]
    for key in sorted({k for _, k, _ in evals}):
        points = [(s, v) for s, k, v in evals if k == key]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=1.5, label=key)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("score (reward units)")
    ax.set_title(f"{name}: reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "reward.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    layers = [[r.get(f"time/{p}", 0.0) or 0.0 for r in rows] for p in PHASES]
    ax.stackplot(steps, layers, labels=[f"time/{p}" for p in PHASES], alpha=0.85)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds per step")
    ax.set_title(f"{name}: step time by phase")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    written.append(out / "step_time.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
