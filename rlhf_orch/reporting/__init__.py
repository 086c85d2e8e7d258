"""Reports over finished runs: one number per run for sweepers (`objective`), and the summary of a
sweep or of runs made separately (`sweep_summary`: summary.csv, summary.md, summary.png).

Pure: reads run dirs (metrics.jsonl, summary.json, .hydra/, error.log), never starts Ray.
"""
