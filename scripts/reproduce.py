"""`python scripts/reproduce.py ...`: the path docs and issues name; the script is scripts/tools/reproduce.py."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "tools" / "reproduce.py"), run_name="__main__")
