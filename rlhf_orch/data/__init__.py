"""Prompt sources: the embedded digit task, and datasets from files or the hub (`rlhf_orch.data.files`,
which reads through `rlhf_orch.data.file_sources`).

The names load on first use (PEP 562): the package's `options` (the config's declarations) must not
pull in numpy.
"""

from importlib import import_module

_NAMES = {
    "Prompt": "rlhf_orch.data.base",
    "PromptSource": "rlhf_orch.data.base",
    "DigitReverseTask": "rlhf_orch.data.digit_task",
    "reward_fn": "rlhf_orch.data.digit_task",
    "score_response": "rlhf_orch.data.digit_task",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
