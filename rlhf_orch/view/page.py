"""report.html: one self-contained file (styles, script and data inlined; no network reference),
readable from disk, from a CI artifact, or served (`rlhf_orch.view.serve`).

The runs' curves, configs and summaries are one JSON block; each dumped step's sequences are a
block of their own, gzip-compressed and base64-encoded, which the page decodes only when that step
is opened: the browser parses a 1000-step run's page without reading its sequences
(docs/run_page.md has the measured sizes and times).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
import os
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from rlhf_orch.reporting.sweep_summary import is_sweep_dir, job_dirs, label_rows, read_run
from rlhf_orch.view.run_data import read_run_page, rollout_steps
from rlhf_orch.view.trajectories import read_step

REPORT = "report.html"


def _asset(name: str) -> str:
    return resources.files("rlhf_orch.view").joinpath("static", name).read_text(encoding="utf-8")


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: every `<` as `\\u003c` (valid JSON, and neither
    `</script>` nor `<!--` can appear: a config or an error that holds them cannot end the block)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")


def _packed(records: list[dict[str, Any]]) -> str:
    raw = json.dumps(records, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


# A dumped step's file does not change once written (a resumed run rewrites a step it runs again:
# a new mtime): its block is made once per process, so a page rewritten every few steps
# (logger.report, --serve) compresses only the new steps. Bounded: cleared past _CACHE_BYTES (the
# driver of a run with logger.report holds at most this much more; a 1000-step run of the default
# 16 sequences of 300 tokens a step is ~40 MB of blocks).
_blocks: dict[tuple[str, int, int], tuple[str, int]] = {}
_CACHE_BYTES = 256 * 2**20


def _step_block(path: Path) -> tuple[str, int]:
    """(the step's records, gzip+base64; lines that did not read)."""
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _blocks:
        if sum(len(b) for b, _ in _blocks.values()) > _CACHE_BYTES:
            _blocks.clear()
        records, bad = read_step(path)
        _blocks[key] = (_packed(records), bad)
    return _blocks[key]


def expand_runs(paths: Sequence[str | Path]) -> list[Path]:
    """The run dirs of `paths`: a sweep (multirun) dir stands for all its jobs."""
    runs: list[Path] = []
    for p in map(Path, paths):
        runs += job_dirs(p) if is_sweep_dir(p) else [p]
    return runs


def default_output(paths: Sequence[str | Path]) -> Path:
    """Where the page goes: into the run dir (or the sweep dir) given alone, else into the
    directory the given dirs share."""
    if len(paths) == 1:
        return Path(paths[0]) / REPORT
    return Path(os.path.commonpath([str(Path(p).resolve()) for p in paths])) / REPORT


def page_data(paths: Sequence[str | Path]) -> tuple[dict[str, Any], list[str]]:
    """The page's JSON block and its step blocks' HTML, for the runs of `paths`."""
    runs = expand_runs(paths)
    rows = [read_run(d) for d in runs]
    if len(runs) > 1:
        label_rows(rows)
    data: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [],
    }
    blocks: list[str] = []
    for k, (run_dir, row) in enumerate(zip(runs, rows)):
        run = read_run_page(run_dir, row)
        run["label"] = row.label or run["name"]
        for step, path in rollout_steps(run_dir):
            try:
                block, bad = _step_block(path)
            except OSError as e:  # (removed or replaced while read)
                run["notes"].append(f"{path.name}: not read ({e.strerror or e})")
                continue
            if bad:
                run["notes"].append(f"{path.name}: {bad} line(s) that do not read (a kill mid-write) left out")
            blocks.append(f'<script type="application/gzip-base64" id="t-{k}-{step}">{block}</script>')
        data["runs"].append(run)
    if not runs:
        data["runs"].append(read_run_page(Path(paths[0])) | {"label": str(paths[0])})
    # What --serve compares to reload the page: the data, not the time it was written.
    data["version"] = hashlib.sha1(
        (_script_json({**data, "generated": ""}) + "".join(blocks)).encode("utf-8")
    ).hexdigest()[:16]
    return data, blocks


def build_page(paths: Sequence[str | Path]) -> tuple[str, str]:
    """(the page's HTML, its data's version: what --serve compares)."""
    data, blocks = page_data(paths)
    runs = data["runs"]
    title = runs[0]["name"] if len(runs) == 1 else f"{len(runs)} runs compared"
    text = "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{html.escape(title)} · rlhf_orch run page</title>",
            f"<style>{_asset('report.css')}</style>",
            "</head><body>",
            "<noscript>This page needs JavaScript (everything it shows is inlined: no network).</noscript>",
            '<div id="app"></div>',
            f'<script type="application/json" id="rlhf-data">{_script_json(data)}</script>',
            *blocks,
            f"<script>{_asset('report.js')}</script>",
            "</body></html>",
        ]
    )
    return text, data["version"]


def write_report(paths: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write the page for the runs of `paths` (run dirs or sweep dirs) to `out` (default:
    `default_output`); written beside and renamed over, so a reader never sees half a page."""
    return write_page(paths, out)[0]


def write_page(paths: Sequence[str | Path], out: str | Path | None = None) -> tuple[Path, str]:
    """`write_report`, and the page's data version."""
    out = Path(out) if out is not None else default_output(paths)
    text, version = build_page(paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out, version
