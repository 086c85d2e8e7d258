"""`python scripts/bench_memory.py ...`: the path docs and issues name; the script is scripts/bench/bench_memory.py."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "bench" / "bench_memory.py"), run_name="__main__")
