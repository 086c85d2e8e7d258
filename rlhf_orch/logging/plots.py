"""PNG plots of one run from its metrics.jsonl, written to <run dir>/plots/.

One file per topic, plus `overview.png` with every panel on one page:

    reward.png            reward/mean, and eval/<source>/mean@k and pass@k when the run evaluated
    kl.png                kl (policy vs reference) and loss/kl (the KL loss term)
    loss.png              loss/policy and loss/value
    response_length.png   response/mean_len and response/max_len
    step_time.png         time/step split by phase (stacked): generate, transfer, experience, train,
                          sync, reward_model and engine_restart when present, the rest as "other"
    throughput.png        perf/tokens_per_s and perf/gen_tokens_per_s
    env.png               multi-turn runs: env/turns_mean and env/tool_calls_mean per trajectory (agents: env/calls_mean)

Readable at a glance: labelled axes with units, the run's name (experiment name and run dir) in
every title, integer step ticks, a smoothed line (rolling mean) with the raw per-step values faint
behind it. A metric the run does not have gets no panel; a topic with none of its metrics gets no
file. Used by the loggers (at the end of a run, every `logger.plot_every_n_steps` steps) and by
`scripts/reproduce.py` reports.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhf_orch.logging.base import finite_or_none, read_metrics

# The phases of time/step, stacked in this order (each phase is one part of the step, one after the other).
PHASES = ("generate", "transfer", "experience", "train", "sync", "reward_model", "engine_restart")
PHASE_COLORS = {
    "generate": "#4C72B0",
    "transfer": "#DD8452",
    "experience": "#55A868",
    "train": "#C44E52",
    "sync": "#8172B3",
    "reward_model": "#937860",
    "engine_restart": "#DA8BC3",
    "other": "#BBBBBB",
}
_EVAL_KEY = re.compile(r"^eval/(?P<source>.+)/(?P<stat>mean|pass)@(?P<k>\d+)$")
_DPI = 110
_MAX_BARS = 40  # the step-time breakdown of runs this short is one stacked bar per step


# --------------------------------------------------------------------------- reading
def series(rows: list[dict], key: str, min_step: int = 1) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, one value per step (the last record of a step wins), in step order."""
    by_step: dict[int, float] = {}
    for r in rows:
        step, value = r.get("step"), finite_or_none(r.get(key))
        if isinstance(step, int) and step >= min_step and value is not None:
            by_step[step] = value
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smoothing_window(n: int) -> int:
    """Steps in the rolling mean: none below 8 points, then about n/15 (odd, at most 51)."""
    if n < 8:
        return 1
    w = max(3, min(51, round(n / 15)))
    return w if w % 2 else w + 1


def smooth(values: list[float], window: int, skip: Optional[list[bool]] = None) -> list[float]:
    """Centred rolling mean (shorter at both ends): no lag behind the raw values. Points marked in
    `skip` (a warm-up step) keep their raw value and stay out of their neighbours' means."""
    if window <= 1:
        return list(values)
    skip = skip or [False] * len(values)
    half = window // 2
    out = []
    for i in range(len(values)):
        part = [
            v for v, s in zip(values[max(0, i - half) : i + half + 1], skip[max(0, i - half) : i + half + 1]) if not s
        ]
        out.append(values[i] if skip[i] or not part else sum(part) / len(part))
    return out


def outliers(values: list[float], factor: float = 3.0) -> list[bool]:
    """Positive quantities (seconds, tokens/s) more than `factor` times off their median: the warm-up
    step (compilation, caches, a first weight sync), kept out of the smoothing."""
    if len(values) < 5:
        return [False] * len(values)
    ordered = sorted(values)
    med = ordered[len(ordered) // 2]
    if med <= 0:
        return [False] * len(values)
    return [v > factor * med or v < med / factor for v in values]


# --------------------------------------------------------------------------- what is drawn
@dataclass
class Line:
    key: str
    label: str
    color: str
    dashed: bool = False
    sparse: bool = False  # evaluations: a few points, drawn as markers joined by a line, never smoothed
    warmup: bool = False  # a positive rate or duration whose warm-up steps stay out of the smoothing


@dataclass
class Panel:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    stacked: bool = False  # the step-time breakdown
    min_step: int = 1  # evaluations also have step 0 (before training)


def _present(rows: list[dict], key: str, min_step: int = 1) -> bool:
    return bool(series(rows, key, min_step)[0])


def panels_for(rows: list[dict]) -> dict[str, list[Panel]]:
    """Per output file (without .png), the panels this run has metrics for (topics without any are left out)."""
    has = lambda key, min_step=1: _present(rows, key, min_step)  # noqa: E731
    files: dict[str, list[Panel]] = {}

    reward = Panel("reward", "score per sample (reward units)", min_step=0)
    if has("reward/mean"):
        reward.lines.append(Line("reward/mean", "reward/mean (train rollouts)", "#1f77b4"))
    eval_keys = sorted(
        {k for r in rows for k in r if _EVAL_KEY.match(k)}, key=lambda k: (_EVAL_KEY.match(k)["source"], k)
    )
    sources = sorted({_EVAL_KEY.match(k)["source"] for k in eval_keys})
    palette = ["#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#ff7f0e"]
    for key in eval_keys:
        if has(key, 0):
            m = _EVAL_KEY.match(key)
            color = palette[sources.index(m["source"]) % len(palette)]
            label = f"{key} (held-out: fraction passed)" if m["stat"] == "pass" else f"{key} (held-out prompts)"
            reward.lines.append(Line(key, label, color, dashed=m["stat"] == "pass", sparse=True))
    if reward.lines:
        files["reward"] = [reward]

    kl = [
        Panel("KL to the reference policy", "KL (nats per token)", [Line("kl", "kl", "#9467bd")]),
        Panel("KL loss term", "KL (nats per token)", [Line("loss/kl", "loss/kl", "#8c564b")]),
    ]
    files["kl"] = [p for p in kl if has(p.lines[0].key)]
    teacher = Panel(
        "reverse KL to the teacher",
        "KL (nats per token)",
        [Line("distill/reverse_kl", "distill/reverse_kl (log pi_old - log pi_teacher, sampled tokens)", "#e377c2")],
    )
    files["distill"] = [teacher] if has("distill/reverse_kl") else []

    loss = [
        Panel(
            "policy loss",
            "loss (as algo.loss_agg aggregates it, unitless)",
            [Line("loss/policy", "loss/policy", "#d62728")],
        ),
        Panel("value loss", "loss (per-token mean, reward units²)", [Line("loss/value", "loss/value", "#ff7f0e")]),
    ]
    files["loss"] = [p for p in loss if has(p.lines[0].key)]

    length = Panel("response length", "tokens per response")
    for key, label, color in (("response/mean_len", "mean", "#2ca02c"), ("response/max_len", "max", "#17becf")):
        if has(key):
            length.lines.append(Line(key, f"{key} ({label})", color))
    files["response_length"] = [length] if length.lines else []

    if has("time/step"):
        files["step_time"] = [Panel("step time by phase", "seconds per step", stacked=True)]

    tput = Panel("throughput", "tokens per second")
    for key, label, color in (
        ("perf/tokens_per_s", "whole step: rollout tokens / time/step", "#1f77b4"),
        ("perf/gen_tokens_per_s", "generation: response tokens / time/generate", "#ff7f0e"),
    ):
        if has(key):
            tput.lines.append(Line(key, f"{key} ({label})", color, warmup=True))
    files["throughput"] = [tput] if tput.lines else []

    env = Panel("multi-turn trajectories (env)", "per trajectory (mean)")
    for key, label, color in (
        ("env/turns_mean", "model turns", "#8c564b"),
        ("env/tool_calls_mean", "tool calls", "#e377c2"),
        ("env/calls_mean", "agent's model calls", "#17becf"),
    ):
        if has(key):
            env.lines.append(Line(key, f"{key} ({label})", color))
    files["env"] = [env] if env.lines else []
    return {name: panels for name, panels in files.items() if panels}


def phase_layers(rows: list[dict]) -> tuple[list[int], dict[str, list[float]], list[float]]:
    """steps, per phase its seconds at each step (phases the run never has are left out; "other" is
    what time/step has beyond them), and time/step itself.

    The stack adds up to time/step. The transfer clock starts when the engines finish generating,
    while the driver's generate clock stops only once the samples arrived: that overlap (the
    gather) is counted as transfer and taken out of generate, as is an engine restart (which
    happens while generating). A streaming transfer counts its part after generation
    (`time/transfer_after_generate`).
    """
    by_step = {
        r["step"]: r
        for r in rows
        if isinstance(r.get("step"), int) and r["step"] >= 1 and finite_or_none(r.get("time/step")) is not None
    }
    steps = sorted(by_step)
    total = [finite_or_none(by_step[s]["time/step"]) for s in steps]
    present = [p for p in PHASES if any(finite_or_none(by_step[s].get(f"time/{p}")) is not None for s in steps)]
    layers: dict[str, list[float]] = {p: [] for p in present}
    other = []
    for s, t in zip(steps, total):
        r = by_step[s]
        v = {p: max(0.0, finite_or_none(r.get(f"time/{p}")) or 0.0) for p in present}
        if "transfer" in v and finite_or_none(r.get("time/transfer_after_generate")) is not None:
            v["transfer"] = max(0.0, finite_or_none(r["time/transfer_after_generate"]))
        if "generate" in v:
            excess = max(0.0, sum(v.values()) - t)
            v["generate"] = max(0.0, v["generate"] - max(excess, v.get("engine_restart", 0.0)))
        for p in present:
            layers[p].append(v[p])
        other.append(max(0.0, t - sum(v.values())))
    if any(o > 0.01 * max(t, 1e-9) for o, t in zip(other, total)):
        layers["other"] = other
    return steps, layers, total


# --------------------------------------------------------------------------- drawing
def _style_axes(ax, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("training step")
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)


def _draw_lines(ax, rows: list[dict], panel: Panel, window: int) -> None:
    for line in panel.lines:
        steps, values = series(rows, line.key, 0 if line.sparse else 1)
        style = "--" if line.dashed else "-"
        if line.sparse:
            ax.plot(steps, values, style, color=line.color, linewidth=1.5, marker="o", markersize=4, label=line.label)
            continue
        few = len(steps) <= 30
        w = min(window, smoothing_window(len(steps)))
        if w > 1:
            ax.plot(steps, values, style, color=line.color, alpha=0.25, linewidth=1)
            ax.plot(
                steps,
                smooth(values, w, outliers(values) if line.warmup else None),
                style,
                color=line.color,
                linewidth=2,
                label=line.label,
            )
        else:
            ax.plot(
                steps,
                values,
                style,
                color=line.color,
                linewidth=2,
                marker="o" if few else None,
                markersize=4,
                label=line.label,
            )
    if len(panel.lines) > 1 or any(line.sparse for line in panel.lines):
        # Room above the data for the legend, so it never hides a line.
        y0, y1 = ax.get_ylim()
        room = min(0.5, 0.05 + 0.065 * len(panel.lines))
        ax.set_ylim(y0, y0 + (y1 - y0) / (1 - room))
        ax.legend(fontsize=8, framealpha=0.9, loc="upper left")


def _draw_stack(ax, rows: list[dict], window: int) -> None:
    steps, layers, total = phase_layers(rows)
    w = min(window, smoothing_window(len(steps)))
    names = list(layers)
    warm = outliers(total)
    smoothed = [smooth(layers[p], w, warm) for p in names]
    colors = [PHASE_COLORS[p] for p in names]
    ax.set_axisbelow(True)  # the grid behind the bars and areas
    bars = len(steps) <= _MAX_BARS  # few steps: one exact stacked bar per step, no smoothing
    if bars:
        bottom = [0.0] * len(steps)
        for p, c in zip(names, colors):
            ax.bar(steps, layers[p], bottom=bottom, width=0.8, color=c, alpha=0.9, label=p)
            bottom = [b + v for b, v in zip(bottom, layers[p])]
        label = None
    else:
        ax.stackplot(steps, smoothed, labels=names, colors=colors, alpha=0.85, linewidth=0)
        label = "time/step (per step)" if w > 1 else "time/step"
        ax.plot(steps, total, color="black", alpha=0.4 if w > 1 else 0.8, linewidth=1, label=label)
    # A slow warm-up step would squash the rest: the scale fits the other steps, the cut-off ones are named.
    off = [
        (s, t)
        for s, t, x in zip(steps, total, warm)
        if x and t > 1.5 * max((v for v, y in zip(total, warm) if not y), default=t)
    ]
    shown = [t for s, t in zip(steps, total) if (s, t) not in off]
    top = max(shown, default=max(total)) * 1.05 or 1.0
    ax.set_ylim(0, top * (1.15 + 0.1 * math.ceil((len(names) + 1) / 4)))  # headroom for the legend
    if off:
        text = ", ".join(f"step {s} {t:.1f} s" for s, t in off[:2]) + (
            f" (+{len(off) - 2} more)" if len(off) > 2 else ""
        )
        # Above the frame's right end: the legend holds the top of the axes.
        ax.annotate(
            f"off scale: {text}",
            xy=(1.0, 1.01),
            xycoords="axes fraction",
            ha="right",
            va="bottom",
            fontsize=7.5,
            color="#444444",
        )
    pad = 0.6 if bars else 0
    ax.set_xlim(steps[0] - pad, steps[-1] + pad)
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index(p) for p in names] + ([labels.index(label)] if label else [])
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        fontsize=7.5,
        framealpha=0.9,
        loc="upper left",
        ncol=4,
        columnspacing=1.0,
        handlelength=1.5,
    )


def _draw(ax, rows: list[dict], panel: Panel, window: int) -> None:
    if panel.stacked:
        _draw_stack(ax, rows, window)
    else:
        _draw_lines(ax, rows, panel, window)
    _style_axes(ax, panel)


def _footnote(window: int) -> str:
    if window <= 1:
        return ""
    return f"lines: faint = per-step values, solid = rolling mean over {window} steps"


def _save(fig, path: Path) -> Path:
    """Written beside and renamed over: a reader (or a refresh) never sees half a file."""
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=_DPI)
    os.replace(tmp, path)
    return path


def run_label(run_dir: str | Path, name: Optional[str] = None) -> str:
    """`<experiment_name> · <run dir name>` (the name from the run's .hydra/config.yaml when not given)."""
    path = Path(run_dir).resolve()
    if name is None:
        name = _experiment_name(path)
    leaf = path.name if path.name != "run" else f"{path.parent.name}/{path.name}"  # scripts/reproduce.py: <time>/run
    label = f"{name} · {leaf}" if name and name != leaf else leaf
    return label.replace("$", r"\$")  # a title, not mathtext


def _experiment_name(run_dir: Path) -> Optional[str]:
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        return None
    return experiment_name_in(config.read_text(encoding="utf-8"))


def experiment_name_in(config_yaml: str) -> Optional[str]:
    """The `experiment_name` a run's .hydra/config.yaml text holds (None: none)."""
    for line in config_yaml.splitlines():
        if line.startswith("experiment_name:"):
            return line.split(":", 1)[1].strip().strip("'\"") or None
    return None


# Figure geometry in inches: every axes the same size, fixed margins (no layout pass: ~2x faster).
_AX_W, _AX_H = 5.4, 2.9
_LEFT, _RIGHT, _BOTTOM, _TOP = 0.9, 0.3, 0.55, 0.3


def _figure(nrows: int, ncols: int, header: float, axes_titles: bool = True):
    """A figure of nrows x ncols axes; `header` inches on top for the title, a line below for the note."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    top = _TOP if axes_titles else 0.12
    cell_w, cell_h = _LEFT + _AX_W + _RIGHT, top + _AX_H + _BOTTOM
    width, height = ncols * cell_w, nrows * cell_h + header + 0.25
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=_LEFT / width,
        right=1 - _RIGHT / width,
        bottom=(_BOTTOM + 0.25) / height,
        top=1 - (header + top) / height,
        wspace=(_LEFT + _RIGHT) / _AX_W,
        hspace=(top + _BOTTOM) / _AX_H,
    )
    return fig, fig.subplots(nrows, ncols, squeeze=False).ravel()


def plot_run(run_dir: str | Path, name: Optional[str] = None, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNGs into `out_dir` (default <run_dir>/plots); returns the files written,
    overview.png first. Nothing is written for a run without a finished step (or evaluation)."""
    rows = read_metrics(run_dir)
    files = panels_for(rows)
    if not files:
        return []
    out = Path(out_dir or Path(run_dir) / "plots")
    out.mkdir(parents=True, exist_ok=True)
    label = run_label(run_dir, name)
    window = smoothing_window(len(series(rows, "time/step")[0]) or len(series(rows, "reward/mean")[0]))
    note = _footnote(window)
    written = []

    def finish(fig, title: str, size: float, path: Path) -> None:
        fig.suptitle(title, fontsize=size, fontweight="bold", y=1 - 0.12 / fig.get_figheight(), va="top")
        if note:
            fig.text(
                1 - 0.1 / fig.get_figwidth(),
                0.08 / fig.get_figheight(),
                note,
                fontsize=7.5,
                color="#555555",
                ha="right",
                va="bottom",
            )
        written.append(_save(fig, path))

    panels = [p for ps in files.values() for p in ps]
    ncols = 2 if len(panels) > 1 else 1
    fig, axes = _figure(math.ceil(len(panels) / ncols), ncols, header=0.45)
    for ax, panel in zip(axes, panels):
        _draw(ax, rows, panel, window)
        ax.set_title(panel.title, fontsize=10.5)
    for ax in axes[len(panels) :]:
        ax.remove()  # an odd number of panels: no empty frame
    finish(fig, f"{label}: overview", 12, out / "overview.png")

    for stem, panels in files.items():
        fig, axes = _figure(1, len(panels), header=0.4, axes_titles=len(panels) > 1 or panels[0].stacked)
        for ax, panel in zip(axes, panels):
            _draw(ax, rows, panel, window)
            if len(panels) > 1:
                ax.set_title(panel.title, fontsize=10.5)
        finish(fig, label if len(panels) > 1 else f"{label}: {panels[0].title}", 11, out / f"{stem}.png")
    return written
