"""One line per step on the console."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlhf_orch.logging.base import StepLogger

# The keys worth a glance every step, in the order shown.
_LINE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
    ("loss/policy", "pg", "{:+.4f}"),
    ("loss/value", "vf", "{:.4f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("time/step", "step", "{:.1f}s"),
    ("time/generate", "gen", "{:.1f}s"),
    ("time/transfer", "xfer", "{:.2f}s"),
    ("time/experience", "exp", "{:.1f}s"),
    ("time/train", "train", "{:.1f}s"),
    ("time/sync", "sync", "{:.2f}s"),
)


def format_step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step:>4}/{total}"]
    for key, label, fmt in _LINE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    failed = (metrics.get("reward/errors") or 0) + (metrics.get("reward/timeouts") or 0)
    if failed:
        parts.append(f"reward failures {failed}")
    # Evaluation results (eval/<source>/mean@k, pass@k), one group per data source.
    for key in sorted(k for k in metrics if k.startswith("eval/") and "/mean@" in k):
        source, stat = key[len("eval/") :].rsplit("/", 1)
        k = stat.split("@", 1)[1]
        passed = metrics.get(f"eval/{source}/pass@{k}")
        parts.append(f"eval {source} mean@{k} {metrics[key]:.3f} pass@{k} {passed:.3f}")
    return " | ".join(parts)


class ConsoleLogger(StepLogger):
    def __init__(self) -> None:
        self.console = Console(highlight=False, soft_wrap=True)
        self.total_steps = 0

    def start(self, run_dir: str, config: dict[str, Any], name: str) -> None:
        super().start(run_dir, config, name)
        self.total_steps = int(config.get("algo", {}).get("num_steps", 0))
        self.console.print(f"[bold]rlhf_orch[/bold] run '{name}' -> {run_dir}")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.console.print(format_step_line(step, self.total_steps, metrics))
