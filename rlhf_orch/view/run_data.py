"""A run dir as the run page shows it: status, config, curves grouped by topic, restarts, the
steps the rollout dump holds, and what is missing. Never raises on what a run dir holds (a run
still going, a killed one, an empty dir): what is not there becomes a line in `notes`.

Built on the readers the other reports use: `read_metrics` (cut lines skipped, superseded steps
kept apart) and `reporting.sweep_summary.read_run` (status and reason, from summary.json or what
is left when there is none); topics follow the PNG plots' files (`logging.plots.panels_for`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rlhf_orch.logging.base import SUPERSEDED, finite_or_none, read_metrics
from rlhf_orch.logging.plots import experiment_name_in, panels_for
from rlhf_orch.reporting.run_row import RunRow
from rlhf_orch.reporting.sweep_summary import read_run

ROLLOUT_FILE = re.compile(r"^step_(\d+)\.jsonl$")
# Restarts the metrics count (cumulative per run): a step where one grows is marked on the curves.
RESTART_KEYS = {"fault/engine_restarts": "engine restarted", "fault/trainer_restarts": "trainers restarted"}


def topics(keys: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every metric key in a topic: the PNG plots' files first (reward, kl, loss, ...; time/* with
    step_time), then one topic per remaining key prefix (`policy/...` -> policy), in key order."""
    placed: dict[str, list[str]] = {}
    for name, panels in panels_for(rows).items():
        placed[name] = [line.key for panel in panels for line in panel.lines]
    if "step_time" in placed or any(k.startswith("time/") for k in keys):
        placed["step_time"] = ["time/step"] + sorted(k for k in keys if k.startswith("time/") and k != "time/step")
    taken = {k for ks in placed.values() for k in ks}
    for key in keys:
        if key not in taken:
            placed.setdefault(key.split("/", 1)[0] if "/" in key else "other", []).append(key)
    return [{"name": name, "keys": [k for k in ks if k in keys]} for name, ks in placed.items() if ks]


def _columns(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics as columns: `steps` and per key its value at each (None where the step lacks it);
    the last record of a step wins (as the plots read it)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in rows:
        if isinstance(r.get("step"), int):
            by_step.setdefault(r["step"], {}).update(r)
    steps = sorted(by_step)
    keys = sorted({k for r in by_step.values() for k, v in r.items() if k not in ("step", SUPERSEDED)})
    series = {}
    for key in keys:
        values = [finite_or_none(by_step[s].get(key)) for s in steps]
        if any(v is not None for v in values):  # numbers only (a string-valued key is not a curve)
            series[key] = values
    return {"steps": steps, "series": series}


def _restarts(rows: list[dict[str, Any]], superseded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Marks on the curves: steps where a restart counter grew, and each step a resume or a
    restart went back to (its later records superseded)."""
    marks = []
    last = {k: 0.0 for k in RESTART_KEYS}
    for r in rows:
        for key, what in RESTART_KEYS.items():
            v = finite_or_none(r.get(key))
            if v is not None and v > last[key]:
                marks.append({"step": r.get("step"), "what": f"{what} ({int(v - last[key])})"})
                last[key] = v
    steps = [r["step"] for r in superseded if isinstance(r.get("step"), int)]
    if steps:
        first = min(steps)
        marks.append({"step": first - 1, "what": f"run again from step {first} (resume or restart)"})
    return marks


def _config(run_dir: Path) -> tuple[str, str]:
    """(.hydra/config.yaml's text, the experiment name in it) ("" when absent)."""
    try:
        text = (run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "", ""
    return text, experiment_name_in(text) or ""


def _summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def rollout_steps(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, file) of every step the rollout dump holds, in step order."""
    folder = run_dir / "rollouts"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := ROLLOUT_FILE.match(p.name))]
    return sorted(found)


def _cut_lines(path: Path) -> int:
    """Lines of a jsonl file that do not read as JSON (a kill mid-write leaves one)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    bad = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            bad += 1
    return bad


def read_run_page(run_dir: str | Path, row: RunRow | None = None) -> dict[str, Any]:
    """One run dir as the page's data (no trajectories: `trajectories.read_step` reads a step);
    `row`: its `read_run` row when the caller has it already."""
    run_dir = Path(run_dir)
    notes: list[str] = []
    everything = read_metrics(run_dir, include_superseded=True)
    rows = [r for r in everything if not r.get(SUPERSEDED)]  # (what read_metrics gives by default)
    superseded = [r for r in everything if r.get(SUPERSEDED)]
    config, name = _config(run_dir)
    summary = _summary(run_dir)
    row = row or read_run(run_dir)
    if not config:
        notes.append("no .hydra/config.yaml: the run's config is unknown")
    if not (run_dir / "metrics.jsonl").is_file():
        notes.append("no metrics.jsonl: no step has finished yet")
    elif cut := _cut_lines(run_dir / "metrics.jsonl"):
        notes.append(f"metrics.jsonl: {cut} line(s) cut (a kill mid-write) left out")
    if summary is None:
        notes.append("no summary.json: the run is still going, or was killed before it could write one")
    steps = rollout_steps(run_dir)
    if not steps:
        notes.append("no rollouts/step_*.jsonl: nothing dumped yet (logger.rollouts=false, or no step finished)")
    columns = _columns(rows)
    return {
        "dir": str(run_dir),
        "name": name or run_dir.name,
        "status": row.status if summary is not None else ("running or killed" if rows else "no steps"),
        "reason": row.reason if summary is not None else "",
        "summary": summary or {},
        "overrides": row.overrides,
        "config": config,
        "metrics": columns,
        "superseded": [
            {"step": r["step"], **{k: finite_or_none(v) for k, v in r.items() if k in columns["series"]}}
            for r in superseded
            if isinstance(r.get("step"), int)
        ],
        "restarts": _restarts(rows, superseded),
        "topics": topics(list(columns["series"]), rows),
        "rollout_steps": [s for s, _ in steps],
        "notes": notes,
    }
