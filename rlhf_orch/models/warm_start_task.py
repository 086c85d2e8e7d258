"""The task the tiny models are warm-started on (the policy's warm start, the reward model's labels)."""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

from rlhf_orch.data.options import DigitTaskConfig, LookupTaskConfig
from rlhf_orch.data.digit_task import DigitReverseTask
from rlhf_orch.data.lookup_task import LookupTask
from rlhf_orch.models.tiny_spec import WarmStartRecipe

# The warm start's own data seed: part of "the model", not of a run (a run's `seed` must not
# rebuild the cached checkpoint).
WARM_START_SEED = 1234


def _task_at_defaults(config: type, task: type) -> DigitReverseTask:
    """`task` with its data config's defaults and the warm start's seed, whatever data option runs:
    a long-context data option (filler tokens) reuses the same checkpoint as the default one."""
    defaults = config()
    kwargs = {f.name: getattr(defaults, f.name) for f in fields(config) if f.name not in ("_target_", "seed")}
    return task(**kwargs, seed=WARM_START_SEED)


def default_warm_start_task() -> DigitReverseTask:
    return _task_at_defaults(DigitTaskConfig, DigitReverseTask)


def lookup_warm_start_task() -> LookupTask:
    """The tool-use task (`model=tiny_tool`)."""
    return _task_at_defaults(LookupTaskConfig, LookupTask)


# `model.warm_start` -> (the task, the recipe). The lookup model never sees long contexts, and
# learns its copy at lr 1e-3 (at the digit task's 3e-3 its copy stayed at chance after 300 steps;
# at 1e-3, 300 clean steps copy every digit greedily).
WARM_STARTS: dict[str, tuple[Callable[[], DigitReverseTask], WarmStartRecipe]] = {
    "digit_reverse": (default_warm_start_task, WarmStartRecipe()),
    "lookup_tool": (lookup_warm_start_task, WarmStartRecipe(lr=1e-3, long_context_every=0)),
}
