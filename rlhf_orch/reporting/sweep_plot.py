"""summary.png: the runs of a sweep (or runs made apart) side by side.

Left, each run's reward curve (`reward/mean` per training step): a rolling mean with the per-step
values faint behind it (no smoothing below 8 steps: then the points, joined). Right, each run's
median step time as one stacked bar per run, split by phase as the runs' own step_time plots split
it (rlhf_orch.logging.plots: the parts add up to time/step). A run without data is still a row of
the bar panel, with its status and reason written in. Colours match between the panels.
Matplotlib's Agg canvas, no pyplot (no global state, no display needed).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Optional, Sequence

from rlhf_orch.logging.plots import PHASE_COLORS, PHASES, smooth, smoothing_window
from rlhf_orch.reporting.run_row import RunRow, tally

_DPI = 110
_STATUS_COLOR = {"failed": "#B22222", "aborted": "#B22222", "interrupted": "#8A6D00"}


def _colors(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:  # tab10 with its red last: red text marks a failed run
        cmap = colormaps["tab10"]
        order = [0, 1, 2, 4, 5, 6, 7, 8, 9, 3]
        return [cmap(order[i]) for i in range(n)]
    cmap = colormaps["tab20"]  # its dark shades first, then the light ones: neighbours differ in hue
    order = [i for i in range(0, 20, 2) if i != 6] + [6] + [i for i in range(1, 20, 2) if i != 7] + [7]
    return [cmap(order[i % 20]) for i in range(n)]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _name(r: RunRow, width: int = 48) -> str:
    return f"{r.job}: {_clip(r.label, width)}" if r.label else r.job


def _same_curves(rows: Sequence[RunRow]) -> list[Optional[int]]:
    """Per row, the index of the first earlier row whose reward curve it repeats exactly (else None)."""
    seen: dict[tuple, int] = {}
    same: list[Optional[int]] = []
    for i, r in enumerate(rows):
        key = tuple((s, round(v, 9)) for s, v in r.curve)
        same.append(seen.get(key) if r.curve else None)
        if r.curve:
            seen.setdefault(key, i)
    return same


def plot_summary(rows: Sequence[RunRow], path: str | Path, title: str, best: Optional[RunRow] = None) -> Path:
    """Write the comparison of `rows` (labelled: `label_rows`) to `path`; returns it."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    n = max(len(rows), 1)
    colors = _colors(len(rows))
    bar_h = max(2.2, 0.42 * n + 1.0)
    reward_h = 3.8
    fig = Figure(figsize=(12.0, reward_h + bar_h + 1.0), layout="constrained")
    fig.get_layout_engine().set(w_pad=0.15, h_pad=0.12, hspace=0.04)
    # Two subfigures: each panel lays out on its own (the bars' long job labels do not narrow the curves).
    top, bottom = fig.subfigures(2, 1, height_ratios=[reward_h, bar_h])
    ax_r, ax_t = top.subplots(), bottom.subplots()

    # ---- reward curves
    longest = max((len(r.curve) for r in rows), default=0)
    window = smoothing_window(longest)
    drawn, missing = 0, []
    same_as = _same_curves(rows)
    for i, (r, c) in enumerate(zip(rows, colors)):
        if not r.curve:
            missing.append(r.job)
            continue
        steps = [s for s, _ in r.curve]
        values = [v for _, v in r.curve]
        style = {"completed": "-", "interrupted": "--"}.get(r.status, ":")
        # Identical curves (a sweep over a setting that does not change the maths, e.g. sync) would hide
        # each other: the first is drawn widest, each copy narrower on top, so every colour shows.
        first = i if same_as[i] is None else same_as[i]
        below = sum(1 for j in range(i + 1, len(rows)) if same_as[j] == first)  # copies drawn over this one
        width = (2.6 if r is best else 1.8) + 1.6 * below
        label = _name(r, 44) + ("" if r.status == "completed" else f" ({r.status})") + (" ★ best" if r is best else "")
        if first != i:
            label += f" (= job {rows[first].job})"
        w = min(window, smoothing_window(len(values)))
        if w > 1:
            ax_r.plot(steps, values, style, color=c, alpha=0.22, linewidth=1)
            ax_r.plot(steps, smooth(values, w), style, color=c, linewidth=width, label=label)
        else:
            ax_r.plot(
                steps, values, style, color=c, linewidth=width, marker="o", markersize=4.5 + 1.6 * below, label=label
            )
        drawn += 1
    ax_r.set_xlabel("training step")
    ax_r.set_ylabel("reward/mean (score per sample, reward units)")
    ax_r.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_r.grid(alpha=0.3, linewidth=0.6)
    ax_r.spines[["top", "right"]].set_visible(False)
    how = f"solid: rolling mean over {window} steps, faint: per step" if window > 1 else "per step"
    note = f"; no reward data: job {', '.join(missing)}" if missing and drawn else ""
    ax_r.set_title(f"reward of the training rollouts ({how}{note})", fontsize=10)
    if drawn:
        if drawn <= 6:
            ax_r.legend(fontsize=8, framealpha=0.85, loc="best")
        else:  # many runs: beside the axes, not over the curves
            ax_r.legend(
                fontsize=7.5,
                framealpha=0.85,
                loc="upper left",
                bbox_to_anchor=(1.01, 1.0),
                ncol=1 if drawn <= 16 else 2,
            )
    else:
        ax_r.text(
            0.5,
            0.5,
            "no run logged a training step",
            transform=ax_r.transAxes,
            ha="center",
            va="center",
            color="#666666",
        )

    # ---- step-time breakdown, one bar per run (top to bottom in job order)
    present = [p for p in (*PHASES, "other") if any(r.stack_s.get(p, 0.0) > 0 for r in rows)]
    ypos = list(range(len(rows)))
    right = max((sum(r.stack_s.values()) for r in rows), default=0.0) or 1.0
    for p in present:
        lefts = [sum(r.stack_s.get(q, 0.0) for q in present[: present.index(p)]) for r in rows]
        widths = [r.stack_s.get(p, 0.0) for r in rows]
        ax_t.barh(
            ypos,
            widths,
            left=lefts,
            height=0.62,
            color=PHASE_COLORS.get(p, "#999999"),
            label=p,
            edgecolor="white",
            linewidth=0.5,
        )
    for y, r in zip(ypos, rows):
        total = sum(r.stack_s.values())
        why = "" if r.status == "completed" else " ".join((r.status + (f": {r.reason}" if r.reason else "")).split())
        color = _STATUS_COLOR.get(r.status, "#333333")
        if total > 0:
            star = "*" if r.timed_steps == 0 else ""
            few = f" ({r.timed_steps} step{'s' if r.timed_steps != 1 else ''})" if 0 < r.timed_steps < 5 else ""
            text = f"{r.step_s if r.step_s is not None else total:.2f} s{star}{few}"
            ax_t.text(
                total + right * 0.01,
                y,
                text + (f"  {_clip(why, 48)}" if why else ""),
                va="center",
                ha="left",
                fontsize=7.5,
                color=color if why else "#333333",
            )
        elif why:  # no step was timed: the reason takes the row
            ax_t.text(right * 0.01, y, _clip(why, 110), va="center", ha="left", fontsize=7.5, color=color)
    ax_t.set_yticks(ypos, [_name(r) + (" ★" if r is best else "") for r in rows], fontsize=8)
    for tick, c in zip(ax_t.get_yticklabels(), colors):
        tick.set_color(c)
    ax_t.set_ylim(len(rows) - 0.5, -0.5 - (0.9 if present else 0.0))  # job 0 on top; room for the legend
    beyond = any(r.status != "completed" and sum(r.stack_s.values()) > 0 for r in rows)
    ax_t.set_xlim(0, right * (1.75 if beyond else 1.12))  # room for the seconds (and a status) after each bar
    ax_t.set_xlabel("seconds per training step (median over the steps after the warm-up step)")
    ax_t.set_title("step time by phase", fontsize=10)
    ax_t.grid(axis="x", alpha=0.3, linewidth=0.6)
    ax_t.spines[["top", "right"]].set_visible(False)
    if present:
        ax_t.legend(
            fontsize=7.5, ncol=len(present), loc="upper left", framealpha=0.9, handlelength=1.2, columnspacing=0.9
        )
    if any(r.timed_steps == 0 and r.stack_s for r in rows):
        ax_t.annotate(
            "* only the warm-up step was timed",
            xy=(1.0, 0.0),
            xycoords="axes fraction",
            xytext=(0, 2),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize=7,
            color="#555555",
        )

    fig.suptitle(textwrap.shorten(title, 140) + f"\n{tally(rows)}", fontsize=11.5, fontweight="bold")
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=_DPI)
    os.replace(tmp, path)
    return path
