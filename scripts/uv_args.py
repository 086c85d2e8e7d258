"""Print, one per line, the `uv pip install` options that make uv install from where pip would.

uv reads none of pip's configuration, so a machine whose pip is pointed at local indexes, wheel
folders or a constraints file (pip.conf's [global] and [install] sections, PIP_* variables) would
resolve elsewhere under uv. This asks pip itself for the options its `install` command would run
with -- every configuration file and variable merged in pip's own order -- and turns index-url,
extra-index-url, find-links, no-index and constraint into uv's options; `--index-strategy
unsafe-best-match` is pip's rule of taking the best version across all indexes (uv's default stops
at the first index naming a package). `--cert` prints pip's CA bundle instead (empty: none), for
uv's SSL_CERT_FILE.

Exits 1 with a one-line reason when this pip cannot be asked (its internal command API moved):
scripts/setup.sh then installs with pip.
"""

from __future__ import annotations

import sys
from typing import Any


def pip_install_options() -> Any:
    """The options `pip install` (no arguments) runs with here: pip's configuration merged."""
    from pip._internal.commands import create_command

    options, _ = create_command("install").parse_args([])
    return options


def uv_args(options: Any) -> list[str]:
    """uv options for pip's install options (`pip_install_options()`)."""
    args = ["--index-strategy", "unsafe-best-match"]
    if options.no_index:
        args.append("--no-index")
    elif options.index_url:
        args += ["--index-url", options.index_url]
    for url in options.extra_index_urls or []:
        args += ["--extra-index-url", url]
    for where in options.find_links or []:
        args += ["--find-links", where]
    for path in options.constraints or []:
        args += ["--constraint", path]
    return args


def main(argv: list[str]) -> int:
    try:
        options = pip_install_options()
    except Exception as e:  # (pip's internal API: another pip version may lay it out otherwise)
        print(f"uv_args: cannot read pip's install options ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    if argv == ["--cert"]:
        print(options.cert or "")
    else:
        print("\n".join(uv_args(options)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
