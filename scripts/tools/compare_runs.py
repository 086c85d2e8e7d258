"""Compare runs made separately: summary.csv, summary.md and summary.png, as a sweep gets them.

    python scripts/tools/compare_runs.py outputs/quick/2026-11-22_07-10-00 outputs/quick/2026-11-22_07-20-00
    python scripts/tools/compare_runs.py outputs/default/* --out outputs/compare/lr
    python scripts/tools/compare_runs.py multirun/quick/2026-11-22_07-00-00      # a sweep dir: all its jobs

A sweep dir given alone is summarised in place (again: e.g. after the sweep was stopped before
Hydra's `on_multirun_end`); a sweep dir among other dirs adds all of its jobs. Without --out the
files go to outputs/compare/<time>. Prints the markdown table. Exit 1 when a given dir does not
exist; runs that failed are rows, not errors.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlhf_orch.reporting.sweep_summary import (
    is_sweep_dir,
    read_run,
    sweep_info,
    sweep_rows,
    sweep_title,
    write_summary,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs (or sweep dirs)")
    parser.add_argument("--out", type=Path, default=None, help="where the summary goes (default: see above)")
    parser.add_argument("--title", default=None, help="title of summary.md and summary.png")
    parser.add_argument("--no-plot", action="store_true", help="summary.csv and summary.md only")
    args = parser.parse_args(argv)

    missing = [str(d) for d in args.runs if not d.is_dir()]
    if missing:
        print(f"error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 1

    info: dict = {}
    if len(args.runs) == 1 and is_sweep_dir(args.runs[0]):
        sweep = args.runs[0]
        rows = sweep_rows(sweep)
        info = sweep_info(sweep)
        out = args.out or sweep
        title = args.title or sweep_title(sweep, info)
    else:
        rows = []
        for d in args.runs:
            if is_sweep_dir(d):
                rows += [r for r in sweep_rows(d)]
            else:
                rows.append(read_run(d, job=str(len(rows))))
        for i, r in enumerate(rows):  # one numbering over everything given
            r.job = str(i)
        out = args.out or Path("outputs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
        title = args.title or f"{len(rows)} runs compared"
    written = write_summary(rows, out, title, info, plot=not args.no_plot)
    print(written["md"].read_text(encoding="utf-8"), end="")
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in written.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
