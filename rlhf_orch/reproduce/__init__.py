"""Reproductions of published runs: references, scaling to a CPU machine, reports (scripts/reproduce.py)."""
