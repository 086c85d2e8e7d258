"""`python scripts/chaos.py ...`: the path docs and issues name; the script is scripts/tools/chaos.py."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "tools" / "chaos.py"), run_name="__main__")
