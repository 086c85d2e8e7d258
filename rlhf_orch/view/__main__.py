"""python -m rlhf_orch.view RUN_DIR [RUN_DIR ...] [--out FILE] [--serve [--port N]]

Writes the run page: <run dir>/report.html for one run dir (or sweep dir: its jobs compared), into
the directory the given dirs share for several, and prints its path. `--serve` serves it on
127.0.0.1 and rewrites it while the runs go on (the page reloads itself); Ctrl-C stops it.

Exit codes: 0 the page was written (a run dir with missing or half-written files gives a page that
says what is missing); 2 a given path is not a directory, the page cannot be written there, the port
cannot be listened on, or a bad option (argparse's own).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_orch.view.page import default_output, write_report

EXIT_BAD_INPUT = 2


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0: any free one)")
    return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_orch.view",
        description=__doc__.splitlines()[2],
        epilog="\n".join(__doc__.splitlines()[3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs, or a multirun (sweep) dir")
    parser.add_argument("--out", type=Path, default=None, help="where the page goes (default: see above)")
    parser.add_argument("--serve", action="store_true", help="serve it on 127.0.0.1 and keep it current")
    parser.add_argument("--port", type=_port, default=8765, help="--serve's port (0: any free one)")
    args = parser.parse_args(argv)

    missing = [str(d) for d in args.runs if not d.is_dir()]
    if missing:
        print(f"error: not a run dir (no such directory): {', '.join(missing)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = args.out or default_output(args.runs)
    try:
        if not args.serve:
            print(write_report(args.runs, out))
            return 0
        from rlhf_orch.view.serve import ReportServer

        server = ReportServer(args.runs, out, port=args.port)
    except OSError as e:
        print(f"error: the page cannot be written or served ({e.strerror or e}: {e.filename or out})", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out)
    print(f"serving on {server.url} (127.0.0.1 only; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
