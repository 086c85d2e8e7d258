"""LoRA on the policy (`model.lora`): what the trainer wraps, what the engines serve.

Pure settings, no torch: the trainer (`rlhf_orch.trainer.lora`) builds the PEFT model from them,
the engines (`rlhf_orch.engines.adapter_serving`) start vLLM with LoRA and take the adapter
tensors, the memory plan and the config check read them. The model option builds them
(`model.lora` is a node of every model option) and the session hands them to the roles.

Two ways the engines get the trained policy (`model.lora.sync`):
- `adapter`: each update sends the adapter tensors only (rank x (in + out) numbers per adapted
  layer), vLLM serves the base with the adapter in memory -- never through the disk;
- `merged`: the trainer merges the adapters into the base weights and pushes every weight, as
  full fine-tuning does (for engines that cannot take an adapter).
`auto` picks `adapter` where vLLM serves the architecture with LoRA, else `merged` (each engine
decides as it starts: `rlhf_orch.engines.adapter_serving.serves_adapter`); the start-up line says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_orch.models.options import LoraConfig

#: model.lora.alpha=null: alpha = this x rank, a scale of 4 whatever the rank. Measured on the default
#: task at the default actor_lr (docs/benchmarks.md, "LoRA"): scale 4 learns at about full
#: fine-tuning's pace, scale 1 (alpha = rank) far slower.
DEFAULT_ALPHA_PER_RANK = 4
#: model.lora.sync values.
SYNC_MODES = ("auto", "adapter", "merged")
#: model.lora.target_modules as one string: PEFT's every-linear-layer-but-the-head (any other string
#: would be a PEFT regex, which the engines and the memory plan could not follow: refused).
ALL_LINEAR = "all-linear"
#: The ranks vLLM's LoRA kernels are built for (`LoRAConfig.max_lora_rank`); an engine takes the
#: smallest one >= the adapter's rank, so no rank above the last can be served.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Layers no adapter may target: the embeddings (PEFT's embedding adapters are another kind,
#: neither merged nor sent here) and the output head (tied to the embedding in most small models,
#: where a merged head would overwrite the embedding; vLLM serves no adapter on it).
NOT_ADAPTABLE = ("embed_tokens", "wte", "embed_in", "word_embeddings", "lm_head", "embed_out")


@dataclass(frozen=True)
class LoraSettings:
    """`model.lora`: rank 0 = full fine-tuning (every other key must stay at its default then)."""

    # (the defaults are the declaration's, `LoraConfig`)
    rank: int = LoraConfig.rank
    alpha: float | None = None  # None: DEFAULT_ALPHA_PER_RANK x rank
    dropout: float = LoraConfig.dropout
    target_modules: Any = ALL_LINEAR  # "all-linear" or a list of module names
    sync: str = LoraConfig.sync

    def __post_init__(self) -> None:
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(DEFAULT_ALPHA_PER_RANK * self.rank))
        if not isinstance(self.target_modules, str):  # a config's ListConfig: a plain, hashable tuple
            object.__setattr__(self, "target_modules", tuple(str(m) for m in self.target_modules))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """PEFT's LoRA scale: the update is `alpha / rank * B @ A`."""
        return self.alpha / self.rank

    def targets(self) -> str | list[str]:
        """`target_modules` as PEFT takes it."""
        t = self.target_modules
        return t if isinstance(t, str) else list(t)

    def peft_kwargs(self) -> dict[str, Any]:
        """`peft.LoraConfig(**...)`: what the trainer wraps the policy with."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.targets(),
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }

    def engine_max_rank(self) -> int:
        """vLLM's `max_lora_rank` for this adapter (the smallest supported value >= rank)."""
        for r in VLLM_MAX_LORA_RANKS:
            if r >= self.rank:
                return r
        raise ValueError(f"model.lora.rank={self.rank} exceeds vLLM's largest LoRA rank {VLLM_MAX_LORA_RANKS[-1]}")

    def refused_targets(self) -> list[str]:
        """Named targets no adapter may have (`NOT_ADAPTABLE`; "all-linear" has none)."""
        t = self.targets()
        return [] if isinstance(t, str) else [m for m in t if m in NOT_ADAPTABLE]
