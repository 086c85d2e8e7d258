"""Checkpoint directories on disk: layout, atomic commit, rotation, and which one `resume=` names.

A checkpoint is a directory `<checkpoint.dir>/step_00000012/`:

    manifest.json     written last: step, weight version, time, run dir, experiment name, roles
                      saved (its presence is what makes the checkpoint complete)
    driver.pt         the driver's state (data sampler position, RNG states, metrics so far,
                      engine restarts, W&B run id) and the resolved config
    policy/ critic/   DeepSpeed checkpoints (weights, optimizer, scheduler; every ZeRO stage),
                      each rank's RNG state beside it
    hf/               (checkpoint.export_hf) the policy in Hugging Face format

Under a `checkpoint.dir` shared by runs (a cluster's shared file system) each run has its own
directory, `<checkpoint.dir>/<run namespace>/step_.../` (`run_checkpoint_root`): saving and rotating
touch that run's checkpoints only, and a restart loads its own.

It is written into `.tmp-step_00000012/` and renamed when complete, so a crash mid-write leaves a
`.tmp-` directory that is never taken as the latest (and is removed by the next commit). Plain
functions on paths and JSON: the config's run-dir resolver uses them before anything else exists;
what a checkpoint holds and how a run saves and restores it is rlhf_orch.orchestration.checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MANIFEST = "manifest.json"
DRIVER_STATE = "driver.pt"
_PREFIX = "step_"
_TMP = ".tmp-"
SUPERSEDED = "superseded"  # checkpoints of a timeline a resume went back past (kept, never resumed by default)


# resume=run_dir: this run's own directory (hydra.run.dir, set by the caller: a requeued Slurm job)
# -- its newest checkpoint, or a fresh start there when it has none yet.
OWN_RUN_DIR = "run_dir"


class ResumeError(ValueError):
    """`resume=` cannot be honoured (nothing to resume, a config change breaks the checkpoint)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def run_checkpoint_root(run_dir: Path, checkpoint_dir: Optional[str] = None) -> Path:
    """Where the run writing into `run_dir` keeps its checkpoints: `<run_dir>/checkpoints`, or its
    own directory under a shared `checkpoint.dir`, named after the run dir (readable) and a hash of
    its absolute path (two runs whose dirs share a name still get two directories)."""
    run_dir = Path(run_dir)
    if not checkpoint_dir:
        return run_dir / "checkpoints"
    absolute = run_dir.expanduser().resolve()  # `.`, a symlink, a relative path: one directory
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{absolute.parent.name}-{absolute.name}").strip("_.") or "run"
    return Path(checkpoint_dir) / f"{readable}-{hashlib.sha1(str(absolute).encode()).hexdigest()[:10]}"


class CheckpointStore:
    """The checkpoints of one run: where the next goes, which are complete, which to delete."""

    def __init__(self, root: Path, keep_last: int):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last} must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        """An empty staging directory for step `step` (a stale one from a crash is replaced)."""
        tmp = self.root / f"{_TMP}{step_dir_name(step)}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, manifest: dict[str, Any]) -> Path:
        """Write the manifest last, then rename: the checkpoint appears complete or not at all."""
        _write_json_atomic(tmp / MANIFEST, {**manifest, "step": step, "written_at": time.time()})
        _fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():  # the same step checkpointed again (a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._rotate()
        return final

    def complete(self) -> list[CheckpointInfo]:
        return complete_checkpoints(self.root)

    def latest(self) -> Optional[CheckpointInfo]:
        done = self.complete()
        return done[-1] if done else None

    def set_aside_after(self, step: int) -> list[Path]:
        """Move the complete checkpoints of steps after `step` into `superseded/` (kept, never
        taken as the latest, never rotated): a run resumed from step `step` continues another
        timeline than theirs, and left in place they would be the "newest" a later `resume=` of
        this run dir (or a requeued job) goes back to, and would rotate away the continuation's
        own checkpoints. Returns where they went."""
        moved = []
        for info in self.complete():
            if info.step > step:
                target = self.root / SUPERSEDED / f"{info.path.name}-{int(time.time())}"
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(info.path, target)
                moved.append(target)
        return moved

    def _rotate(self) -> None:
        for info in self.complete()[: -self.keep_last]:
            shutil.rmtree(info.path, ignore_errors=True)
        for stale in self.root.glob(f"{_TMP}*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest step first."""
    out = []
    for d in Path(root).glob(f"{_PREFIX}*"):
        manifest = _read_manifest(d)
        if manifest is not None:
            out.append(CheckpointInfo(d, int(manifest["step"]), manifest))
    return sorted(out, key=lambda c: c.step)


def _read_manifest(d: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def find_checkpoint(
    resume: str, experiments_root: Path, checkpoint_dir: Optional[str] = None, experiment_name: Optional[str] = None
) -> CheckpointInfo:
    """The checkpoint `resume=` names: a checkpoint dir, a run dir (its latest), or "auto": the most
    recently written complete checkpoint of this experiment's own runs (manifest `experiment_name`)
    under `experiments_root` (outputs/<experiment_name>) or `checkpoint_dir` -- never one another
    experiment wrote into a shared directory."""
    if resume == "auto":
        # A shared checkpoint.dir: every run's own directory in it (and checkpoints written
        # straight into it by earlier versions).
        roots = (
            [Path(checkpoint_dir), *sorted(p for p in Path(checkpoint_dir).glob("*") if p.is_dir())]
            if checkpoint_dir
            else []
        )
        roots += [p / "checkpoints" for p in Path(experiments_root).glob("*") if p.is_dir()]
        found = [c for r in roots for c in complete_checkpoints(r)]
        mine = [c for c in found if experiment_name is None or c.manifest.get("experiment_name") == experiment_name]
        if not mine:
            others = f" ({len(found)} of other experiments)" if found else ""
            raise ResumeError(
                f"resume=auto: no complete checkpoint of experiment_name={experiment_name!r} under "
                f"{experiments_root}/*/checkpoints"
                + (f" or {checkpoint_dir}" if checkpoint_dir else "")
                + f"{others}; start without resume= or name a run dir or checkpoint dir"
            )
        return max(mine, key=lambda c: (c.manifest.get("written_at", 0.0), c.step))
    path = Path(resume).expanduser()
    if not path.exists():
        raise ResumeError(f"resume={resume!r}: no such directory; give a run dir, a checkpoint dir or 'auto'")
    manifest = _read_manifest(path)
    if manifest is not None:
        return CheckpointInfo(path, int(manifest["step"]), manifest)
    # A run dir: its newest checkpoint, in it or in its own directory under a shared checkpoint.dir
    # (a run may have written both: started without checkpoint.dir, resumed with it).
    roots = {path / "checkpoints", path, *([run_checkpoint_root(path, checkpoint_dir)] if checkpoint_dir else [])}
    done = [c for root in roots for c in complete_checkpoints(root)]
    if done:
        return max(done, key=lambda c: (c.step, c.manifest.get("written_at", 0.0)))
    raise ResumeError(
        f"resume={resume!r}: no complete checkpoint there (a checkpoint dir has {MANIFEST}; a run dir has "
        "checkpoints/step_*); a run killed before its first checkpoint cannot be resumed"
    )


def continuation_of(
    resume: str, experiments_root: Path, checkpoint_dir: Optional[str] = None, experiment_name: Optional[str] = None
) -> str:
    """What a requeued job given `resume=<resume>` by hand resumes: the newest checkpoint its earlier
    attempts wrote after that one (they continued it, into its run dir; a checkpoint of another
    timeline there was set aside when they resumed: `CheckpointStore.set_aside_after`), else
    `resume` itself. Without this a requeue would go back to the hand-given checkpoint every time.
    A hand-given checkpoint dir that is gone was rotated away by the newer ones written beside it
    (checkpoint.keep_last): the newest of those."""
    given = Path(resume).expanduser()
    if not given.exists() and given.name.startswith(_PREFIX) and complete_checkpoints(given.parent):
        return str(complete_checkpoints(given.parent)[-1].path)
    info = find_checkpoint(resume, experiments_root, checkpoint_dir, experiment_name)
    run_dir = info.manifest.get("run_dir")
    if not run_dir:
        return resume
    later = [c for c in complete_checkpoints(run_checkpoint_root(Path(run_dir), checkpoint_dir)) if c.step > info.step]
    return str(later[-1].path) if later else resume


def run_dir_of(
    resume: Optional[str], default: str, experiment_name: Optional[str] = None, checkpoint_dir: Optional[str] = None
) -> str:
    """Where a run writes: the resumed run's own dir (metrics continue in place), else `default`.

    Registered as the `rlhf_run_dir` resolver of `hydra.run.dir`; anything unresolvable falls back to
    `default` and `find_checkpoint` reports it properly once the app runs.
    """
    if not resume or resume == OWN_RUN_DIR:
        return default
    try:
        root = Path(default).parent if resume == "auto" else Path(resume)
        info = find_checkpoint(resume, root, checkpoint_dir, experiment_name)
        return info.manifest.get("run_dir") or default
    except (ResumeError, OSError, KeyError, ValueError):
        return default


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
