"""Print, one per line, the `uv pip install` options that make uv install what pip would here.

uv reads none of pip's configuration, so a machine whose pip is pointed at local indexes, wheel
folders or a constraints file (pip.conf, PIP_* variables) would resolve elsewhere under uv. This
reads `pip config list` (every file and the environment, as pip merges them: the environment over
the site file over the user's over the global one) and turns index-url, extra-index-url,
find-links and constraint into uv's options; `--index-strategy unsafe-best-match` is pip's rule of
taking the best version across all indexes (uv's default stops at the first index naming a
package). Used by scripts/setup.sh; prints nothing it does not understand.

    python scripts/uv_args.py [pip config list output on stdin]
"""

from __future__ import annotations

import shlex
import sys

#: Where a `pip config list` key comes from, lowest precedence first (pip's own order).
VARIANTS = ("global", "user", "site", ":env:")
#: pip's key -> uv's option; every one of them may hold several values.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def uv_args(pip_config_list: str) -> list[str]:
    """uv options for the settings `pip config list` printed (`variant.key='value'` lines)."""
    chosen: dict[str, tuple[int, list[str]]] = {}
    for line in pip_config_list.splitlines():
        name, sep, raw = line.partition("=")
        variant, dot, key = name.strip().rpartition(".")
        if not sep or not dot or variant not in VARIANTS or key not in OPTIONS:
            continue
        rank = VARIANTS.index(variant)
        if key not in chosen or rank >= chosen[key][0]:
            chosen[key] = (rank, shlex.split(raw.strip())[0].split() if raw.strip() else [])
    args = ["--index-strategy", "unsafe-best-match"]
    for key, (_, values) in chosen.items():
        if key == "index-url":
            values = values[:1]  # one index replaces PyPI
        for value in values:
            args += [OPTIONS[key], value]
    return args


if __name__ == "__main__":
    print("\n".join(uv_args(sys.stdin.read())))
