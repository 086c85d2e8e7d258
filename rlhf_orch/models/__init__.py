"""Model options: where the policy checkpoint comes from (built locally or a Hugging Face one).

The classes load on first use (PEP 562): `rlhf_orch.models.hub`, which the config checks use to
refuse a hub id missing from the local cache, must not pull in transformers and torch (~4 s).
"""

from importlib import import_module

_CLASSES = {
    "HFModel": "rlhf_orch.models.hf",
    "ModelSource": "rlhf_orch.models.base",
    "PackagedGGUFModel": "rlhf_orch.models.gguf",
    "TinyLlama": "rlhf_orch.models.tiny",
}

__all__ = sorted(_CLASSES)


def __getattr__(name: str):
    if name in _CLASSES:
        return getattr(import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
