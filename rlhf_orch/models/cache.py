"""Build a checkpoint directory once, shared safely between processes.

Many processes (Ray actors of every role) may ask for the same locally built model at once. The
first one to take the file lock builds it into a temporary directory and renames it into place;
the rename is atomic, so a directory under its final name is always complete, and everyone else
either finds it or waits on the lock and then finds it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock

# Torch threads of a local build: fixed, so a build's result does not depend on how many cores the
# builder happens to see (part of each recipe, hence of its cache key).
BUILD_THREADS = 2


def build_once(cache_dir: Path, name: str, build: Callable[[Path], None]) -> str:
    """`cache_dir/name`, built by `build(staging_dir)` first if no process has built it yet."""
    final = cache_dir / name
    if final.is_dir():  # fast path: the rename below makes a present directory a complete one
        return str(final)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f"{name}.lock")):
        if not final.is_dir():  # another process may have built it while we waited
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=cache_dir))
            try:
                build(staging)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return str(final)
