"""Submit `python run.py <overrides>` to a running Ray cluster as a Ray Job.

    python -m launchers.submit_ray_job --address http://HEAD:8265 experiment=gpu_split_qwen placement.nodes=2
    python -m launchers.submit_ray_job --follow placement=split placement.ratio=3:1

The repository is uploaded as the job's working_dir (Ray excludes .git and what .gitignore lists;
outputs and environments are excluded below), and `launcher=cluster` is added unless an override
already picks a launcher, because inside a job the driver must join the cluster, not start one.
Prints the job id; with --follow, streams the logs and exits with the job's outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

REPO_ROOT = Path(__file__).resolve().parent.parent
# Large or machine-local folders that must not be uploaded with the working_dir.
UPLOAD_EXCLUDES = [".venv", "outputs", "multirun", ".git", "**/__pycache__", "*.egg-info"]


def build_entrypoint(python: str, script: str, overrides: list[str]) -> str:
    chosen = list(overrides)
    if not any(override.lstrip("+~").startswith("launcher=") for override in chosen):
        chosen.insert(0, "launcher=cluster")
    return shlex.join([python, script, *chosen])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265",
        help="Ray dashboard address of the cluster (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS or %(default)s)",
    )
    parser.add_argument("--working-dir", default=str(REPO_ROOT), help="folder uploaded as the job's working_dir")
    parser.add_argument("--python", default="python", help="interpreter on the cluster nodes")
    parser.add_argument("--script", default="run.py", help="entry script inside the working dir")
    parser.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks one)")
    parser.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides passed to run.py")
    return parser.parse_args(argv)


async def follow(client: JobSubmissionClient, job_id: str) -> JobStatus:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)
    return client.get_job_status(job_id)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = [override for override in args.overrides if override != "--"]
    entrypoint = build_entrypoint(args.python, args.script, overrides)
    client = JobSubmissionClient(args.address)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        submission_id=args.submission_id,
        runtime_env={"working_dir": args.working_dir, "excludes": UPLOAD_EXCLUDES},
    )
    print(job_id, flush=True)
    if not args.follow:
        print(
            f"submitted: {entrypoint}\nlogs: ray job logs --address {args.address} --follow {job_id}", file=sys.stderr
        )
        return 0
    status = asyncio.run(follow(client, job_id))
    print(f"\njob {job_id} ended: {status.value}", file=sys.stderr)
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
