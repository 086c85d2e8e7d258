"""Model options: where the policy checkpoint comes from (built locally or a Hugging Face one)."""

from rlhf_orch.models.base import ModelSource
from rlhf_orch.models.hf import HFModel
from rlhf_orch.models.tiny import TinyLlama

__all__ = ["HFModel", "ModelSource", "TinyLlama"]
