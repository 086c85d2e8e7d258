"""How a run compares with the published numbers: measured value, difference, verdict; report.md.

Pure: published numbers and the run's metrics rows in, rows of a comparison out. A verdict is one
of "within tolerance", "not within tolerance", "not measured here" (with the reason), and a
projected figure is always labelled "projected".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

from rlhf_orch.reproduce.reference import PublishedNumber, Reference

WITHIN, OUTSIDE, NOT_MEASURED = "within tolerance", "not within tolerance", "not measured here"


@dataclass
class Comparison:
    number: PublishedNumber
    measured: Optional[float]
    verdict: str
    note: str = ""

    @property
    def difference(self) -> Optional[float]:
        return None if self.measured is None else self.measured - float(self.number.value)


def measured_value(rows: list[dict], metric: str, at_step: Optional[int]) -> Optional[float]:
    """The metric at `at_step` (the nearest logged step), or its median over steps >= 2 (after warm-up)."""
    points = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None and "step" in r]
    if not points:
        return None
    if at_step is not None:
        return min(points, key=lambda p: (abs(p[0] - at_step), p[0]))[1]
    steady = [v for s, v in points if s >= 2] or [v for _, v in points]
    return statistics.median(steady)


def compare(reference: Reference, rows: list[dict], comparable: bool, why_not: str = "") -> list[Comparison]:
    """One row per published number. `comparable=False` (a scaled run) reports the measured figure
    but gives no verdict on it: a tiny model on 2 CPU cores does not measure a 7B model on GPUs."""
    out = []
    for n in reference.numbers:
        if n.metric is None:
            out.append(Comparison(n, None, NOT_MEASURED, "no metric of ours measures it"))
            continue
        value = measured_value(rows, n.metric, n.at_step)
        if value is None:
            out.append(Comparison(n, None, NOT_MEASURED, f"the run logged no {n.metric}"))
        elif not comparable:
            out.append(Comparison(n, value, NOT_MEASURED, why_not))
        else:
            out.append(Comparison(n, value, _verdict(n, value)))
    return out


def _verdict(n: PublishedNumber, value: float) -> str:
    tol = float(n.tolerance or 0.0)
    if n.comparison == "at_least":
        return WITHIN if value >= float(n.value) - tol else OUTSIDE
    if n.comparison == "at_most":
        return WITHIN if value <= float(n.value) + tol else OUTSIDE
    if n.tolerance is None:
        return NOT_MEASURED
    return WITHIN if abs(value - float(n.value)) <= tol else OUTSIDE


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_report(
    reference: Reference,
    mode: str,
    command: str,
    comparisons: list[Comparison],
    plan: str,
    reductions: list[str],
    differences: list[tuple[str, Any, Any]],
    projections: list[dict[str, Any]],
    plots: list[str],
    studies: list[str] = (),
) -> str:
    src = reference.source
    lines = [
        f"# {reference.title}",
        "",
        f"Experiment `{reference.experiment}`, {mode}. Command: `{command}`",
        "",
        f"Source: {src.get('repo', '-')} {', '.join(src.get('files', []) or [])} at {src.get('commit') or 'unknown commit'}"
        + (f"; {src['paper']}" if src.get("paper") else ""),
        f"Published hardware: {reference.hardware}",
        "",
        "## Published numbers and this run",
        "",
        "| number | published | measured here | difference | verdict | what it measures |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        n = c.number
        bound = {"within": "±", "at_least": "at least, -", "at_most": "at most, +"}[n.comparison]
        tol = f" ({bound}{n.tolerance:g})" if n.tolerance is not None else ""
        verdict = c.verdict + (f" ({c.note})" if c.note else "")
        lines.append(
            f"| {n.name} | {_fmt(n.value)} {n.unit}{tol} | {_fmt(c.measured)} | {_fmt(c.difference)} | {verdict} | {n.measures} |"
        )
    if not comparisons:
        lines.append("| (none published) | | | | | |")
    if projections:
        lines += [
            "",
            "## Projected for the published hardware (cost models, not measured)",
            "",
            "| figure | projected | published | basis |",
            "|---|---|---|---|",
        ]
        for p in projections:
            lines.append(f"| {p['figure']} | projected: {p['projected']} | {p.get('published', '-')} | {p['basis']} |")
    for study in studies:
        lines += ["", study]
    lines += ["", "## The plan the published cluster gets (`launcher.dry_run=true`)", "", "```", plan.rstrip(), "```"]
    if reductions:
        lines += ["", "## Scaled to this machine: what was reduced and why", ""] + [f"- {r}" for r in reductions]
    if differences:
        lines += [
            "",
            "## Exact config differences (published -> this run)",
            "",
            "| key | published | this run |",
            "|---|---|---|",
        ]
        lines += [f"| `{k}` | {_fmt(a)} | {_fmt(b)} |" for k, a, b in differences]
    if reference.not_modelled:
        lines += ["", "## Published settings this system does not model", ""]
        lines += [f"- {item}" for item in reference.not_modelled]
    if reference.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in reference.notes]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"
