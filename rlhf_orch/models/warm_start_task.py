"""The task the tiny models are warm-started on (the policy's warm start, the reward model's labels)."""

from __future__ import annotations

from dataclasses import fields

from rlhf_orch.config.schema import DigitTaskConfig
from rlhf_orch.data.digit_task import DigitReverseTask

# The warm start's own data seed: part of "the model", not of a run (a run's `seed` must not
# rebuild the cached checkpoint).
WARM_START_SEED = 1234


def default_warm_start_task() -> DigitReverseTask:
    """The data config's defaults, whatever data option runs: a long-context data option (filler
    tokens) reuses the same checkpoint as the default one."""
    defaults = DigitTaskConfig()
    kwargs = {f.name: getattr(defaults, f.name) for f in fields(DigitTaskConfig) if f.name not in ("_target_", "seed")}
    return DigitReverseTask(**kwargs, seed=WARM_START_SEED)
