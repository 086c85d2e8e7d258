"""What a requeued Slurm job resumes when `resume=` was given by hand (ray_cluster.sbatch calls it).

    python launchers/slurm/requeue_resume.py <the job's overrides...>   # prints the resume= value

The job's earlier attempts continued the hand-given checkpoint into its run dir: the newest of
those, else the hand-given one (`rlhf_orch.checkpoint_dirs.continuation_of`). Without a hand-given
`resume=` the template resumes `run_dir` (this job's own run dir) and does not call this.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlhf_orch.checkpoint_dirs import OWN_RUN_DIR, continuation_of


def requeue_resume(overrides: list[str], experiments_root: Path = Path("outputs")) -> str:
    values = dict(arg.split("=", 1) for arg in overrides if "=" in arg and not arg.startswith(("+", "~")))
    resume = values.get("resume")
    if not resume or resume in (
        OWN_RUN_DIR,
        "auto",
    ):  # (auto: the experiment's newest, which the earlier attempts wrote)
        return resume or OWN_RUN_DIR
    return continuation_of(
        resume, experiments_root, values.get("checkpoint.dir") or None, values.get("experiment_name")
    )


if __name__ == "__main__":
    print(requeue_resume(sys.argv[1:]))
