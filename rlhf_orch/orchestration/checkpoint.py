"""Checkpoints on disk: layout, atomic commit, rotation, finding the one to resume, config drift.

A checkpoint is a directory `<checkpoint.dir>/step_00000012/`:

    manifest.json     written last: step, weight version, time, run dir, roles saved (its presence
                      is what makes the checkpoint complete)
    driver.pt         the driver's state (data sampler position, RNG states, metrics so far,
                      engine restarts, W&B run id) and the resolved config
    policy/ critic/   DeepSpeed checkpoints (weights, optimizer, scheduler; every ZeRO stage),
                      each rank's RNG state in its `client_state`
    hf/               (checkpoint.export_hf) the policy in Hugging Face format

It is written into `.tmp-step_00000012/` and renamed when complete, so a crash mid-write leaves a
`.tmp-` directory that is never taken as the latest (and is removed by the next commit).
Plain functions on paths and dicts: tested without Ray.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import torch

MANIFEST = "manifest.json"
DRIVER_STATE = "driver.pt"
_PREFIX = "step_"
_TMP = ".tmp-"


class ResumeError(ValueError):
    """`resume=` cannot be honoured (nothing to resume, a config change breaks the checkpoint)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


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


def find_checkpoint(resume: str, experiments_root: Path, checkpoint_dir: Optional[str] = None) -> CheckpointInfo:
    """The checkpoint `resume=` names: a checkpoint dir, a run dir (its latest), or "auto" (the
    latest complete checkpoint of any run under `experiments_root` = outputs/<experiment_name>)."""
    if resume == "auto":
        roots = [Path(checkpoint_dir)] if checkpoint_dir else []
        roots += [p / "checkpoints" for p in Path(experiments_root).glob("*") if p.is_dir()]
        found = [c for r in roots for c in complete_checkpoints(r)]
        if not found:
            raise ResumeError(
                f"resume=auto: no complete checkpoint under {experiments_root}/*/checkpoints"
                + (f" or {checkpoint_dir}" if checkpoint_dir else "")
                + "; start without resume= or name a run dir"
            )
        return max(found, key=lambda c: (c.manifest.get("written_at", 0.0), c.step))
    path = Path(resume).expanduser()
    if not path.exists():
        raise ResumeError(f"resume={resume!r}: no such directory; give a run dir, a checkpoint dir or 'auto'")
    manifest = _read_manifest(path)
    if manifest is not None:
        return CheckpointInfo(path, int(manifest["step"]), manifest)
    for root in (path / "checkpoints", path):
        done = complete_checkpoints(root)
        if done:
            return done[-1]
    raise ResumeError(
        f"resume={resume!r}: no complete checkpoint there (a checkpoint dir has {MANIFEST}; a run dir has "
        "checkpoints/step_*); a run killed before its first checkpoint cannot be resumed"
    )


def run_dir_of(resume: Optional[str], default: str) -> str:
    """Where a run writes: the resumed run's own dir (metrics continue in place), else `default`.

    Registered as the `rlhf_run_dir` resolver of `hydra.run.dir`; anything unresolvable falls back to
    `default` and `find_checkpoint` reports it properly once the app runs.
    """
    if not resume:
        return default
    try:
        root = Path(default).parent if resume == "auto" else Path(resume)
        info = find_checkpoint(resume, root)
        return info.manifest.get("run_dir") or default
    except (ResumeError, OSError, KeyError, ValueError):
        return default


# ---------------------------------------------------------------------------------- config drift
# Keys whose change makes a checkpoint meaningless for the run (weights' shapes, the optimizer's
# partitioning, which roles exist, what the sampler position counts).
BREAKING_KEYS = (
    "model",
    "placement",
    "trainer.zero_stage",
    "algo._target_",
    "data._target_",
    "data.train_files",
    "data.seed",
    "seed",
)
# Keys that never affect the trained policy.
HARMLESS_KEYS = ("logger", "launcher", "checkpoint", "algo.num_steps", "eval", "experiment_name", "fault", "reference")


def config_drift(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """(breaking, other, harmless) changed keys between the checkpoint's config and this run's."""
    changed = sorted(k for k in _diff(saved, current) if k != "resume")
    breaking = [k for k in changed if _under(k, BREAKING_KEYS)]
    harmless = [k for k in changed if _under(k, HARMLESS_KEYS)]
    other = [k for k in changed if k not in breaking and k not in harmless]
    return breaking, other, harmless


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _diff(a: Any, b: Any, key: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {k for sub in set(a) | set(b) for k in _diff(a.get(sub, _MISSING), b.get(sub, _MISSING), f"{key}.{sub}" if key else str(sub))}
    return set() if a == b else {key}


_MISSING = object()


# ---------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def engine_seed(seed: int, step: int, engine: int) -> int:
    """The sampling seed of engine `engine` for step `step`: a resumed step draws what the
    uninterrupted run drew, and a replaced engine draws from a known state."""
    return int(np.random.SeedSequence([seed, step, engine]).generate_state(1)[0])


# ---------------------------------------------------------------------------------- small helpers
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


def dir_size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------- resume
@dataclass
class ResumePoint:
    info: CheckpointInfo
    state: dict[str, Any]  # driver.pt
    changed: list[str]  # config keys changed since the checkpoint (none of them breaking)

    @property
    def step(self) -> int:
        return self.info.step


def load_resume(
    resume: str, experiments_root: Path, checkpoint_dir: Optional[str], config: dict[str, Any], num_steps: int
) -> ResumePoint:
    """The checkpoint `resume=` names, its driver state, and the config changes since (ResumeError
    when a change breaks it or nothing is left to run)."""
    info = find_checkpoint(resume, experiments_root, checkpoint_dir)
    state = torch.load(info.path / DRIVER_STATE, weights_only=False)
    breaking, other, harmless = config_drift(state["config"], config)
    if breaking:
        raise ResumeError(
            f"resume={resume}: the checkpoint {info.path} was written with a different {', '.join(breaking)}; "
            "resume with the same values (or start a new run)"
        )
    if info.step >= num_steps:
        raise ResumeError(
            f"resume={resume}: the checkpoint is at step {info.step} and algo.num_steps={num_steps} leaves nothing to run; "
            f"raise algo.num_steps (e.g. algo.num_steps={info.step + max(num_steps, 1)})"
        )
    return ResumePoint(info, state, other + harmless)


def save_checkpoint(
    store: CheckpointStore, step: int, actors: Any, get: Any, driver_state: dict[str, Any], export_hf: bool, manifest: dict[str, Any]
) -> Path:
    """Every trainer role's DeepSpeed state (all ranks at once), then the driver's, then commit."""
    tmp = store.begin(step)
    roles = {name: ranks for name, ranks in (("policy", actors.policy), ("critic", actors.critic)) if ranks}
    calls = [rank.save_checkpoint.remote(str(tmp / name)) for name, ranks in roles.items() for rank in ranks]
    get(calls, f"writing the checkpoint of step {step}")
    if export_hf:
        get([rank.export_hf.remote(str(tmp / "hf")) for rank in actors.policy], "exporting the policy")
    torch.save(driver_state, tmp / DRIVER_STATE)
    return store.commit(tmp, step, {**manifest, "roles": sorted(roles), "hf": export_hf})


def restore_trainers(path: Path, actors: Any, get: Any) -> None:
    roles = (("policy", actors.policy), ("critic", actors.critic))
    get([rank.load_checkpoint.remote(str(path / name)) for name, ranks in roles for rank in ranks], f"loading the checkpoint {path}")
