"""The run page: `python -m rlhf_orch.view RUN_DIR` writes <run dir>/report.html (curves and every
dumped trajectory, token by token), one self-contained file (`rlhf_orch.view.page`)."""
