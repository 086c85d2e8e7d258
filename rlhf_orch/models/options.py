"""The `model` group's declarations (and `model.lora`): where the policy checkpoint comes from
(`rlhf_orch.models.tiny`, `.hf`, `.gguf`; `rlhf_orch.models.lora`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class LoraConfig:
    """model.lora: the policy trains LoRA adapters on the frozen base (`peft`); rank 0 = off (full
    fine-tuning). rlhf_orch.models.lora says what each key does and how the engines get the adapter."""

    _target_: str = "rlhf_orch.models.lora.LoraSettings"
    rank: int = 0  # adapter rank; 0 = full fine-tuning
    alpha: Optional[float] = None  # the update is alpha / rank * B @ A; null = 4 x rank (docs/lora.md)
    dropout: float = 0.0  # on the adapters' input, training forwards only
    target_modules: Any = "all-linear"  # PEFT's: "all-linear" or a list of module names (q_proj, ...)
    sync: str = "auto"  # what each weight sync moves: adapter (its tensors only), merged (every weight), auto


@dataclass
class ModelConfig:
    _target_: str = MISSING
    context_len: int = 2048  # max_position_embeddings the engines and trainers may use
    dtype: str = "float32"  # "float32" on CPU, "bfloat16" on GPUs
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TinyModelConfig(ModelConfig):
    """A small Llama and tokenizer built locally, warm-started on the embedded task, cached."""

    _target_: str = "rlhf_orch.models.tiny.TinyLlama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # head_dim = hidden/heads must be >= 32 for vLLM's CPU attention
    intermediate_size: int = 256
    vocab_size: int = 64
    warmup_steps: int = 150  # short supervised warm start so PPO starts from partial skill
    # What it is warm-started on: the digit task, or the lookup tool task (model=tiny_tool).
    warm_start: str = "digit_reverse"
    cache_dir: str = "${oc.env:RLHF_ORCH_CACHE,${oc.env:HOME}/.cache/rlhf_orch}"


@dataclass
class HFModelConfig(ModelConfig):
    """A Hugging Face checkpoint (GPU clusters)."""

    _target_: str = "rlhf_orch.models.hf.HFModel"
    name_or_path: str = MISSING
    dtype: str = "bfloat16"


@dataclass
class PackagedGGUFModelConfig(ModelConfig):
    """A real model shipped as a GGUF file inside a Python package (installed with --no-deps, never
    imported), dequantized once into a float32 Hugging Face checkpoint in the model cache."""

    _target_: str = "rlhf_orch.models.gguf.PackagedGGUFModel"
    distribution: str = MISSING  # the package (pip name) that ships the file
    version: str = MISSING  # its pinned version (part of the cache key)
    gguf_file: str = MISSING  # the file's path inside the installed package
    # A student (model=smollm2_student): only the first N decoder layers, with the file's embeddings,
    # head, final norm, tokenizer and chat template; null = the whole model.
    layers: Optional[int] = None
    cache_dir: str = "${oc.env:RLHF_ORCH_CACHE,${oc.env:HOME}/.cache/rlhf_orch}"
