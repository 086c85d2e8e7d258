"""What a checkpoint holds and how a run writes and restores it: the driver's state (loaded as data
only), config drift since the checkpoint, every trainer role's DeepSpeed state, engine seeds.

Where checkpoints are on disk and which one `resume=` names: rlhf_orch.checkpoint_dirs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import torch

from rlhf_orch.checkpoint_dirs import DRIVER_STATE, CheckpointInfo, CheckpointStore, ResumeError, find_checkpoint

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
# Keys that never affect the trained policy (placement.reference_in_actor: the same log-probs in
# another process, bit for bit -- tests/orchestration/test_warm_actors.py).
HARMLESS_KEYS = (
    "logger",
    "launcher",
    "checkpoint",
    "algo.num_steps",
    "eval",
    "experiment_name",
    "fault",
    "reference",
    "placement.reference_in_actor",
)


def config_drift(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """(breaking, other, harmless) changed keys between the checkpoint's config and this run's."""
    changed = sorted(k for k in _diff(saved, current) if k != "resume")
    breaking = [k for k in changed if _under(k, BREAKING_KEYS)]
    harmless = [k for k in changed if _under(k, HARMLESS_KEYS)]
    other = [k for k in changed if k not in breaking and k not in harmless]
    return breaking, other, harmless


def _at(config: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _diff(a: Any, b: Any, key: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {
            k
            for sub in set(a) | set(b)
            for k in _diff(a.get(sub, _MISSING), b.get(sub, _MISSING), f"{key}.{sub}" if key else str(sub))
        }
    return set() if a == b else {key}


_MISSING = object()


# ---------------------------------------------------------------------------------- RNG states
def engine_seed(seed: int, step: int, engine: int) -> int:
    """The sampling seed of engine `engine` for step `step`: a resumed step draws what the
    uninterrupted run drew, and a replaced engine draws from a known state."""
    return int(np.random.SeedSequence([seed, step, engine]).generate_state(1)[0])


# ---------------------------------------------------------------------------------- small helpers
def dir_size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------- resume
@dataclass
class ResumePoint:
    info: CheckpointInfo
    state: dict[str, Any]  # driver.pt
    changed: list[str]  # config keys changed since the checkpoint (none of them breaking)
    notes: list[str] = field(default_factory=list)  # what resuming does differently from the checkpoint (one line each)

    @property
    def step(self) -> int:
        return self.info.step


def load_driver_state(path: Path) -> dict[str, Any]:
    """driver.pt loaded as data only (`weights_only=True`): containers, numbers, strings, tensors and
    the rollout dataclasses a one-step-off checkpoint carries -- a file that would run code on load
    (any other pickled global) is refused, naming what it holds."""
    from rlhf_orch.transfer.base import HeldRollout
    from rlhf_orch.transfer.batch import Sample
    from rlhf_orch.transfer.rollout_meta import RolloutMeta

    try:
        # (RolloutMeta under its earlier module too: checkpoints written before it moved hold that name)
        earlier = (RolloutMeta, "rlhf_orch.transfer.engine_side.RolloutMeta")
        with torch.serialization.safe_globals([HeldRollout, RolloutMeta, earlier, Sample]):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) or str(e).splitlines()[0]
        raise ResumeError(
            f"{path} holds more than data (it would import {unsafe} to load); "
            "resume only from checkpoints this project wrote"
        ) from None


def load_resume(
    resume: str,
    experiments_root: Path,
    checkpoint_dir: Optional[str],
    config: dict[str, Any],
    num_steps: int,
    experiment_name: Optional[str] = None,
) -> ResumePoint:
    """The checkpoint `resume=` names, its driver state, and the config changes since (ResumeError
    when a change breaks it or nothing is left to run)."""
    info = find_checkpoint(resume, experiments_root, checkpoint_dir, experiment_name)
    state = load_driver_state(info.path / DRIVER_STATE)
    breaking, other, harmless = config_drift(state["config"], config)
    if breaking:
        raise ResumeError(
            f"resume={resume}: the checkpoint {info.path} was written with a different {', '.join(breaking)}; "
            "resume with the same values (or start a new run)"
        )
    if state.get("pending_rollout") is not None:
        # The rollout generated ahead is in the format of the pipeline that holds it and the
        # transfer that exported it: another one could not put it back. Its sequences carry their
        # rewards as env.reward placed them (per_turn: per token), which another value would not.
        moved = [
            k
            for k in ("pipeline._target_", "transfer._target_", "env.reward")
            if _at(state["config"], k) != _at(config, k)
        ]
        if (
            moved == ["pipeline._target_"]
            and str(_at(state["config"], moved[0])).endswith("OneStepOffPipeline")
            and str(_at(config, moved[0])).endswith("AsyncPipeline")
            and (_at(config, "pipeline.max_staleness") or 0) >= 1
        ):
            moved = []  # the async pipeline takes a one-step-off rollout (staleness 1) as its first ready one
        if moved:
            held_by = ", ".join(f"{k}={_at(state['config'], k)}" for k in moved)
            raise ResumeError(
                f"resume={resume}: the checkpoint {info.path} carries the rollouts generated ahead of step {info.step}, "
                f"held by {held_by}; resume with the same "
                f"{' and '.join(k.split('.')[0] for k in moved)} (change it at a checkpoint of a run that holds no rollout)"
            )
    notes = _within_the_staleness_bound(resume, info, state, config)
    if info.step >= num_steps:
        raise ResumeError(
            f"resume={resume}: the checkpoint is at step {info.step} and algo.num_steps={num_steps} leaves nothing to run; "
            f"raise algo.num_steps (e.g. algo.num_steps={info.step + max(num_steps, 1)})"
        )
    return ResumePoint(info, state, other + harmless, notes)


def checkpoint_zero_stages(state: dict[str, Any]) -> dict[str, int]:
    """The ZeRO stage each trained role's DeepSpeed state in a checkpoint was written at (DeepSpeed
    loads a state only into an engine of its stage): as its driver state records it (`zero_stages`),
    or -- a checkpoint written before a one-rank role ran stage 0 (`zero_stage_to_run`) -- its
    config's trainer.zero_stage for every role, the stage every role ran then."""
    if state.get("zero_stages") is not None:
        return {role: int(stage) for role, stage in state["zero_stages"].items()}
    configured = int(_at(state["config"], "trainer.zero_stage") or 0)
    return {"actor": configured, "critic": configured}


def _within_the_staleness_bound(
    resume: str, info: CheckpointInfo, state: dict[str, Any], config: dict[str, Any]
) -> list[str]:
    """Carried rollouts that would train above the resumed run's `pipeline.max_staleness` (lowered
    since the checkpoint) are not trained: the first such rollout and every later one are dropped
    and the sampler goes back to before the first one's prompts were drawn, so the resumed run
    draws them again, each within the bound (none is skipped, none trained twice). A checkpoint
    without the sampler positions (written before they were kept) is refused instead."""
    pending = state.get("pending_rollout")
    bound = _at(config, "pipeline.max_staleness")
    if not pending or bound is None:
        return []
    rollouts = sorted(pending if isinstance(pending, list) else [pending], key=lambda h: h.step)
    # Step j trains with the trainers at version j - 1: a sample drawn by version v is j - 1 - v behind.
    behind = [max(h.step - 1 - v for v in h.meta.weight_versions) if h.meta.weight_versions else 0 for h in rollouts]
    first = next((k for k, b in enumerate(behind) if b > bound), None)
    if first is None:
        return []
    step = rollouts[first].step
    before = (state.get("data_before_pending") or {}).get(step)
    if before is None:
        raise ResumeError(
            f"resume={resume}: the checkpoint {info.path} carries the rollout of step {step} drawn {behind[first]} versions behind, "
            f"more than pipeline.max_staleness={bound}, and not the sampler's position before it (an older checkpoint); "
            f"resume with pipeline.max_staleness={max(behind)} and lower it at a later checkpoint"
        )
    kept = rollouts[:first]
    state["pending_rollout"] = (kept if isinstance(pending, list) else kept[0]) if kept else None
    state["data"] = before
    dropped = [h.step for h in rollouts[first:]]
    # Their positions belong to the draws dropped here: the resumed run records its own as it draws again.
    state["data_before_pending"] = {
        s: d for s, d in (state.get("data_before_pending") or {}).items() if s not in dropped
    }
    return [
        f"resume: the carried rollout{'s' if len(dropped) > 1 else ''} of step{'s' if len(dropped) > 1 else ''} "
        f"{', '.join(map(str, dropped))} (up to {max(behind[first:])} versions behind) exceed pipeline.max_staleness={bound}: "
        "drawn again (the sampler goes back to before their prompts)"
    ]


def save_checkpoint(
    store: CheckpointStore,
    step: int,
    actors: Any,
    get: Any,
    driver_state: dict[str, Any],
    export_hf: bool,
    manifest: dict[str, Any],
    timeout_s: float,
) -> Path:
    """Every trainer role's DeepSpeed state (all ranks at once), then the driver's, then commit.
    Each of the two waits (the save, the export) may take `timeout_s` (checkpoint.timeout_s)."""
    tmp = store.begin(step)
    roles = {name: ranks for name, ranks in (("policy", actors.policy), ("critic", actors.critic)) if ranks}
    calls = [rank.save_checkpoint.remote(str(tmp / name)) for name, ranks in roles.items() for rank in ranks]
    get(calls, f"writing the checkpoint of step {step}", timeout=_checkpoint_timeout(timeout_s))
    if export_hf:
        export_policy(actors, get, tmp / "hf", timeout_s)
    torch.save(driver_state, tmp / DRIVER_STATE)
    return store.commit(tmp, step, {**manifest, "roles": sorted(roles), "hf": export_hf})


def export_policy(actors: Any, get: Any, directory: Path, timeout_s: float) -> None:
    """The policy in Hugging Face format (every rank takes part: ZeRO-3 gathers its shards)."""
    get(
        [rank.export_hf.remote(str(directory)) for rank in actors.policy],
        "exporting the policy",
        timeout=_checkpoint_timeout(timeout_s),
    )


def restore_trainers(path: Path, actors: Any, get: Any, timeout_s: float) -> None:
    roles = (("policy", actors.policy), ("critic", actors.critic))
    get(
        [rank.load_checkpoint.remote(str(path / name)) for name, ranks in roles for rank in ranks],
        f"loading the checkpoint {path}",
        timeout=_checkpoint_timeout(timeout_s),
    )


def _checkpoint_timeout(timeout_s: float) -> tuple[float, str]:
    """A checkpoint wait's limit and the key that sets it (named if it runs out)."""
    return timeout_s, "checkpoint.timeout_s"
