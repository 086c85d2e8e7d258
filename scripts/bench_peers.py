"""`python scripts/bench_peers.py ...`: the path docs and issues name; the script is scripts/bench/bench_peers.py."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "bench" / "bench_peers.py"), run_name="__main__")
