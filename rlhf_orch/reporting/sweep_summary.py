"""One row per run: how it ended, its rewards, its step time; for a sweep or for runs made apart.

    rows = sweep_rows(Path("multirun/quick/2026-11-22_07-00-00"))     # the jobs of one multirun
    rows = [read_run(d) for d in run_dirs]                              # runs made separately
    write_summary(rows, out_dir, title)   # summary.csv, summary.md, summary.png (sweep_plot)

`SweepSummary` is the Hydra callback (conf/config.yaml, `hydra.callbacks.sweep_summary`) that
writes them into the sweep dir when a multirun ends; `scripts/tools/compare_runs.py` does the same for
run dirs given on the command line.

A row comes from the run dir alone: `.hydra/overrides.yaml` (what the run changed), summary.json
(`status`, `steps`, `reward_first`/`reward_last`, `eval_last`; written at the end of every run,
also a failed one), error.log (the reason of a failure) and metrics.jsonl (the reward curve and
the step times). A job without summary.json is "failed" with the last line of its error.log, or
"no summary.json": a job dir with nothing in it still gets its row.

Step times are medians over the training steps after the first one of each process (the first
step of a run, or of a resumed run, includes the engines' warm-up); a run with only warm-up steps
has its medians over those (`timed_steps` 0 says so).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from rlhf_orch.logging.base import finite_or_none, read_metrics
from rlhf_orch.reporting.run_row import PHASES, STATUSES, RunRow, tally
from rlhf_orch.reporting.scores import eval_score

try:  # Hydra is a dependency of the project; the pure functions below do not need it
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]

COLUMNS = (
    "job",
    "label",
    "status",
    "reason",
    "steps",
    "reward_first",
    "reward_last",
    "eval_last",
    "eval_metric",
    "step_s_median",
    *(f"{p}_s_median" for p in PHASES),
    "timed_steps",
    "wall_s",
    "overrides",
    "run_dir",
)
_JOB_NUM = re.compile(r"^(\d+)(?:_|$)")
_REWARD_WINDOW = 5  # as run_summary: the mean of the first/last max(1, min(5, n // 3)) steps


# --------------------------------------------------------------------------- reading one run
def _read_json(path: Path) -> tuple[Optional[dict[str, Any]], str]:
    """(the object, "") or (None, why not)."""
    if not path.is_file():
        return None, f"no {path.name}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path.name} unreadable: {e}"
    if not isinstance(data, dict):
        return None, f"{path.name} is not a JSON object"
    return data, ""


def last_line(path: Path) -> str:
    """The last non-empty line of a text file ("" when missing or empty)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return last[2:] if last.startswith("- ") else last  # a configuration error's last problem is a bullet


def read_overrides(run_dir: Path) -> list[str]:
    """The run's command-line overrides: .hydra/overrides.yaml, else the job dir's name after `N_`."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            data = None
        if isinstance(data, list):
            return [str(x) for x in data]
    m = _JOB_NUM.match(run_dir.name)
    rest = run_dir.name[m.end() :] if m else ""
    return [rest] if rest else []


def _dry_run(run_dir: Path) -> bool:
    """launcher.dry_run in the run's .hydra/config.yaml: the run only printed its plan."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
        return bool(((config or {}).get("launcher") or {}).get("dry_run"))
    except (OSError, yaml.YAMLError, AttributeError):
        return False


def _training_rows(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per training step (step >= 1, the last record of a step wins), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in metrics:
        step = r.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 1:
            by_step[step] = r
    return [by_step[s] for s in sorted(by_step)]


def timed_rows(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose times count: not the first step of a process (a run, or each resume of it,
    starts with the engines' warm-up). A new process shows as a new `time/startup` or an
    `time/elapsed` that went backwards."""
    kept = []
    prev: Optional[dict[str, Any]] = None
    for r in train:
        first = prev is None or r.get("step") != prev.get("step", 0) + 1
        if prev is not None and not first:
            startup, prev_startup = finite_or_none(r.get("time/startup")), finite_or_none(prev.get("time/startup"))
            elapsed, prev_elapsed = finite_or_none(r.get("time/elapsed")), finite_or_none(prev.get("time/elapsed"))
            first = (startup is not None and prev_startup is not None and startup != prev_startup) or (
                elapsed is not None and prev_elapsed is not None and elapsed < prev_elapsed
            )
        if not first:
            kept.append(r)
        prev = r
    return kept


def _median(rows: Iterable[dict[str, Any]], key: str) -> Optional[float]:
    values = [v for v in (finite_or_none(r.get(key)) for r in rows) if v is not None]
    return statistics.median(values) if values else None


def _mean_window(values: list[float], first: bool) -> Optional[float]:
    if not values:
        return None
    k = max(1, min(_REWARD_WINDOW, len(values) // 3))
    part = values[:k] if first else values[-k:]
    return sum(part) / len(part)


def _stack(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per phase as each run's step_time plot stacks them (rlhf_orch.logging.plots):
    the parts add up to time/step (a streaming transfer counts its part after generation)."""
    if not rows:
        return {}
    from rlhf_orch.logging.plots import phase_layers

    steps, layers, _total = phase_layers(rows)
    if not steps:
        return {}
    return {phase: statistics.median(values) for phase, values in layers.items()}


def read_run(run_dir: str | Path, job: str = "") -> RunRow:
    """The row of one run dir, whatever state it is in (no files at all included)."""
    run_dir = Path(run_dir)
    if not job:
        m = _JOB_NUM.match(run_dir.name)
        job = m.group(1) if m else run_dir.name
    metrics = read_metrics(run_dir)
    summary, why_not = _read_json(run_dir / "summary.json")
    train = _training_rows(metrics)
    rewards = [(r["step"], v) for r in train if (v := finite_or_none(r.get("reward/mean"))) is not None]

    if summary is not None:
        status = str(summary.get("status") or "failed")
        if status not in STATUSES:
            status = "failed"
        reason = ""
        if status == "failed":
            reason = (
                str(summary.get("error") or "")
                or last_line(run_dir / "error.log")
                or "failed (summary.json names no error)"
            )
        elif status in ("interrupted", "aborted"):
            reason = f"stopped by {summary.get('signal') or 'a signal'}"
            if status == "aborted":
                reason += " (second signal: the step in progress was abandoned)"
        steps = summary.get("steps")
        steps = (
            int(steps)
            if isinstance(steps, (int, float)) and not isinstance(steps, bool)
            else max((s for s, _ in rewards), default=0)
        )
        reward_first, reward_last = (
            finite_or_none(summary.get("reward_first")),
            finite_or_none(summary.get("reward_last")),
        )
        evaluation = summary.get("eval_last") if isinstance(summary.get("eval_last"), dict) else None
        wall = finite_or_none(summary.get("wall_s"))
    else:
        status, reason = "failed", last_line(run_dir / "error.log")
        if not reason and _dry_run(run_dir):
            status, reason = "dry_run", "planned only, nothing trained"
        reason = reason or why_not
        steps = max((r["step"] for r in train), default=0)
        values = [v for _, v in rewards]
        reward_first, reward_last = _mean_window(values, True), _mean_window(values, False)
        evals = [r for r in metrics if eval_score(r) is not None]
        evaluation = evals[-1] if evals else None
        wall = finite_or_none(train[-1].get("time/elapsed")) if train else None

    score = eval_score(evaluation)
    timed = timed_rows(train)
    over = timed or train  # only warm-up steps: their medians (timed_steps = 0 says so)
    return RunRow(
        run_dir=run_dir,
        job=job,
        overrides=read_overrides(run_dir),
        status=status,
        reason=reason,
        steps=steps,
        reward_first=reward_first,
        reward_last=reward_last,
        eval_last=score[0] if score else None,
        eval_metric=score[1] if score else "",
        step_s=_median(over, "time/step"),
        phases_s={p: _median(over, f"time/{p}") for p in PHASES},
        timed_steps=len(timed),
        wall_s=wall,
        curve=rewards,
        stack_s=_stack(over),
    )


# --------------------------------------------------------------------------- a sweep's jobs
def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The job dirs of a multirun: the numbered subdirs (`${hydra.job.num}_${override_dirname}`),
    in job order. An override value with a `/` nests the job dir deeper: then the dir holding
    `.hydra/` below the numbered one is the job's."""
    sweep_dir = Path(sweep_dir)
    found = []
    for child in sorted(p for p in sweep_dir.iterdir() if p.is_dir()) if sweep_dir.is_dir() else []:
        m = _JOB_NUM.match(child.name)
        if not m:
            continue
        found.append((int(m.group(1)), _job_root(child)))
    return [d for _, d in sorted(found, key=lambda t: (t[0], str(t[1])))]


def _job_root(top: Path) -> Path:
    if (top / ".hydra").is_dir() or (top / "summary.json").exists() or (top / "metrics.jsonl").exists():
        return top
    for root, dirs, _files in os.walk(top):
        if ".hydra" in dirs:
            return Path(root)
        dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "policy_hf", "plots"))
    return top


def sweep_rows(sweep_dir: str | Path) -> list[RunRow]:
    """One row per job of the sweep (jobs that wrote nothing included)."""
    rows = []
    for d in job_dirs(sweep_dir):
        m = _JOB_NUM.match(d.relative_to(sweep_dir).parts[0])
        rows.append(read_run(d, job=m.group(1) if m else d.name))
    return rows


def is_sweep_dir(path: str | Path) -> bool:
    """A multirun's sweep dir: multirun.yaml (Hydra writes it there), or numbered job subdirs and
    no run of its own."""
    path = Path(path)
    if (path / "multirun.yaml").is_file():
        return True
    return not (path / "metrics.jsonl").exists() and not (path / ".hydra").is_dir() and bool(job_dirs(path))


def sweep_info(sweep_dir: str | Path) -> dict[str, Any]:
    """What the multirun left: the chosen `sweep` option (multirun.yaml, or a job's .hydra/hydra.yaml),
    the optimiser's best trial (optimization_results.yaml)."""
    import yaml

    sweep_dir = Path(sweep_dir)
    info: dict[str, Any] = {}
    # multirun.yaml (the basic sweeper writes it; Optuna's does not: then a job's .hydra/hydra.yaml).
    for path in [sweep_dir / "multirun.yaml", *(d / ".hydra" / "hydra.yaml" for d in job_dirs(sweep_dir)[:1])]:
        try:
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
            choice = (((config or {}).get("hydra") or {}).get("runtime") or {}).get("choices", {}).get("sweep")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if choice:
            info["sweep"] = choice
            break
    try:
        result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text(encoding="utf-8"))
        if isinstance(result, dict) and "best_params" in result:
            info["best_params"] = {str(k): v for k, v in (result.get("best_params") or {}).items()}
            info["best_value"] = result.get("best_value")
    except (OSError, yaml.YAMLError):
        pass
    return info


# --------------------------------------------------------------------------- labels
def _short_value(override: str) -> str:
    key, sep, value = override.partition("=")
    if not sep:
        return override
    try:
        number = float(value)
    except ValueError:
        return override
    if len(value) <= 8 or value.strip().lstrip("+-").isdigit():  # short already (0.0, 1e-4, 0.05)
        return override
    return f"{key}={number:.3g}"


def common_overrides(rows: Sequence[RunRow]) -> list[str]:
    """Overrides every row has (in the first row's order); none for a single row."""
    if len(rows) < 2:
        return []
    shared = set(rows[0].overrides).intersection(*(set(r.overrides) for r in rows[1:]))
    return [o for o in rows[0].overrides if o in shared]


def label_rows(rows: Sequence[RunRow]) -> list[RunRow]:
    """Each row's label: its overrides that not every row has (floats to 3 digits); the dir name
    where that does not tell runs apart."""
    common = set(common_overrides(rows))
    for r in rows:
        r.label = ",".join(_short_value(o) for o in r.overrides if o not in common) or (
            "(no overrides)" if len(rows) == 1 else ""
        )
    seen: dict[str, int] = {}
    for r in rows:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in rows:
        if not r.label or seen[r.label] > 1:
            r.label = f"{r.label} [{r.run_dir.name}]" if r.label else r.run_dir.name
    return list(rows)


def best_row(rows: Sequence[RunRow], info: dict[str, Any]) -> Optional[RunRow]:
    """The row of the optimiser's best trial (its params match the row's overrides)."""
    params = info.get("best_params")
    if not params:
        return None
    for r in rows:
        given = dict(o.split("=", 1) for o in r.overrides if "=" in o)
        if all(k in given and _same(given[k], v) for k, v in params.items()):
            return r
    return None


def _same(text: str, value: Any) -> bool:
    if str(value) == text:
        return True
    try:
        return math.isclose(float(text), float(value), rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- writing
def _write_atomic(path: Path, text: str) -> Path:
    """Written beside and renamed over: a reader (or a job writing the same file) never sees half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def csv_text(rows: Sequence[RunRow]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(r.csv_record())
    return buf.getvalue()


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _num(v: Optional[float], digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _sec(v: Optional[float]) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def markdown_text(
    rows: Sequence[RunRow], title: str, info: Optional[dict[str, Any]] = None, plot: Optional[str] = "summary.png"
) -> str:
    info = info or {}
    best = best_row(rows, info)
    lines = [f"# {title}", "", tally(rows) + "."]
    common = common_overrides(rows)
    if common:
        lines += ["", "Common overrides: " + " ".join(f"`{o}`" for o in common)]
    if "best_value" in info:
        params = ", ".join(f"`{k}={v}`" for k, v in info.get("best_params", {}).items())
        where = f" (job {best.job})" if best else ""
        lines += [
            "",
            f"Best trial{where}: {params} with objective {info['best_value']:.4g} (optimization_results.yaml).",
        ]
    lines += [
        "",
        "| job | overrides | status | steps | reward first → last | eval | step s | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " |",
        "|---" * (7 + len(PHASES)) + "|",
    ]
    for r in rows:
        status = r.status if not r.reason else f"{r.status}: {_cell(r.reason)}"
        mark = " ★" if best is r else ""
        step_s = _sec(r.step_s) + ("*" if r.step_s is not None and r.timed_steps == 0 else "")
        cells = [
            r.job + mark,
            f"`{_cell(r.label, 200)}`" if r.label else "",
            status,
            str(r.steps),
            f"{_num(r.reward_first)} → {_num(r.reward_last)}" if r.reward_first is not None else "–",
            _num(r.eval_last),
            step_s,
            *(_sec(r.phases_s.get(p)) for p in PHASES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Rewards: mean `reward/mean` of the first / last max(1, min(5, steps // 3)) steps (summary.json). "
        "Eval: the last evaluation's `eval/<source>/mean@k` (mean over sources). Times: median seconds per "
        "step, over the steps after the first of each process (that one includes the engines' warm-up); "
        "* = the run had only warm-up steps, medians over those.",
    ]
    if best is not None:
        lines.append("★ = the optimiser's best trial.")
    if plot:
        lines += ["", f"![{title}]({plot})"]
    return "\n".join(lines) + "\n"


def write_summary(
    rows: Sequence[RunRow], out_dir: str | Path, title: str, info: Optional[dict[str, Any]] = None, plot: bool = True
) -> dict[str, Path]:
    """summary.csv, summary.md and (with `plot`, when matplotlib works) summary.png in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = label_rows(rows)
    written = {"csv": _write_atomic(out / "summary.csv", csv_text(rows))}
    png: Optional[Path] = None
    if plot:
        from rlhf_orch.reporting.sweep_plot import plot_summary

        try:
            png = plot_summary(rows, out / "summary.png", title, best=best_row(rows, info or {}))
        except Exception as e:  # a broken plot must not cost the table
            print(f"sweep summary: summary.png not written: {type(e).__name__}: {e}", file=sys.stderr)
    written["md"] = _write_atomic(out / "summary.md", markdown_text(rows, title, info, png.name if png else None))
    if png:
        written["png"] = png
    return written


def sweep_title(sweep_dir: Path, info: dict[str, Any]) -> str:
    path = sweep_dir.resolve()
    name = f"{path.parent.name}/{path.name}"
    return f"sweep={info['sweep']} · {name}" if info.get("sweep") else name


def write_sweep_summary(sweep_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """The summary of every job of the multirun in `sweep_dir`, written into it."""
    sweep_dir = Path(sweep_dir)
    info = sweep_info(sweep_dir)
    return write_summary(sweep_rows(sweep_dir), sweep_dir, sweep_title(sweep_dir, info), info, plot)


# --------------------------------------------------------------------------- the Hydra callback
class SweepSummary(Callback):
    """`hydra.callbacks.sweep_summary` (conf/config.yaml): at the end of every multirun, the sweep
    dir gets summary.csv, summary.md and summary.png. Single runs are left alone."""

    def __init__(self, plot: bool = True) -> None:
        self.plot = plot

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            info = sweep_info(sweep_dir)
            rows = sweep_rows(sweep_dir)
            written = write_summary(rows, sweep_dir, sweep_title(sweep_dir, info), info, self.plot)
        except Exception as e:  # the jobs ran: a summary problem is reported, not raised
            print(f"sweep summary: not written: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return
        print(f"sweep summary ({tally(rows)}): {written['md']}", flush=True)
