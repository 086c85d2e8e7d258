"""LoRA on the policy (`model.lora`): what the trainer wraps, what the engines serve, what a sync moves.

Pure settings and names, no torch: the trainer (`rlhf_orch.trainer.lora`) builds the PEFT model
from them, the engines (`rlhf_orch.engines.adapter_update`) start vLLM with LoRA and take the
adapter tensors, the memory plan and the config check read them.

Two ways the engines get the trained policy (`model.lora.sync`):
- `adapter`: each update sends the adapter tensors only (2 x rank x (in + out) numbers per target
  layer), vLLM serves the base with the adapter in memory -- never through the disk;
- `merged`: the trainer merges the adapters into the base weights and pushes every weight, as
  full fine-tuning does (for engines that cannot take an adapter).
`auto` picks `adapter` where vLLM serves the architecture with LoRA, else `merged` (each engine
decides as it starts: `rlhf_orch.engines.adapter_serving.serves_adapter`); the start-up line says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

#: model.lora.alpha=null: alpha = this x rank, a scale of 4 whatever the rank. Measured on the default
#: task at the default actor_lr (docs/lora.md): scale 4 learns at about full fine-tuning's pace, scale 1
#: (alpha = rank) a third as fast.
DEFAULT_ALPHA_PER_RANK = 4
#: model.lora.sync values.
SYNC_MODES = ("auto", "adapter", "merged")
#: The ranks vLLM's LoRA kernels are built for (`LoRAConfig.max_lora_rank`); an engine takes the
#: smallest one >= the adapter's rank.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The adapter's name and id in every engine: one adapter, replaced in place at each update.
ADAPTER_NAME = "policy"
ADAPTER_ID = 1
#: Output heads: PEFT adapts them as linear layers (merged sync only); vLLM serves no adapter on them.
HEADS = ("lm_head", "embed_out")
#: Embeddings: PEFT's embedding adapters are another kind (lora_embedding_A/B) -- not supported here.
EMBEDDINGS = ("embed_tokens", "wte", "embed_in", "word_embeddings")


@dataclass(frozen=True)
class LoraSettings:
    """`model.lora`: rank 0 = full fine-tuning (every other key must stay at its default then)."""

    rank: int = 0
    alpha: float | None = None  # None: DEFAULT_ALPHA_PER_RANK x rank
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # PEFT's: a list of module names, or "all-linear"
    sync: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(DEFAULT_ALPHA_PER_RANK * self.rank))

    @property
    def scaling(self) -> float:
        """PEFT's LoRA scale: the update is `alpha / rank * B @ A`."""
        return self.alpha / self.rank

    def targets(self) -> str | list[str]:
        """`target_modules` as PEFT takes it (a config's ListConfig becomes a list)."""
        t = self.target_modules
        return t if isinstance(t, str) else [str(m) for m in t]

    def peft_kwargs(self) -> dict[str, Any]:
        """`peft.LoraConfig(**...)`: what the trainer wraps the policy with."""
        return {"r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": self.targets(),
                "bias": "none", "task_type": "CAUSAL_LM"}

    def engine_max_rank(self) -> int:
        """vLLM's `max_lora_rank` for this adapter (the smallest supported value >= rank)."""
        for r in VLLM_MAX_LORA_RANKS:
            if r >= self.rank:
                return r
        raise ValueError(f"model.lora.rank={self.rank} exceeds vLLM's largest LoRA rank {VLLM_MAX_LORA_RANKS[-1]}")

    def unservable_targets(self) -> list[str]:
        """Targeted layers an engine cannot take an adapter on (named lists only; "all-linear"
        never targets the head)."""
        t = self.targets()
        return [] if isinstance(t, str) else [m for m in t if m in HEADS]

    def embedding_targets(self) -> list[str]:
        t = self.targets()
        return [] if isinstance(t, str) else [m for m in t if m in EMBEDDINGS]


def lora_settings(config: Any) -> Optional[LoraSettings]:
    """The settings of a `model.lora` node (typed, DictConfig or an instance); None when off."""
    if config is None:
        return None
    settings = config if isinstance(config, LoraSettings) else LoraSettings(
        rank=int(config.rank), alpha=None if config.alpha is None else float(config.alpha), dropout=float(config.dropout),
        target_modules=config.target_modules if isinstance(config.target_modules, str) else [str(m) for m in config.target_modules],
        sync=str(config.sync),
    )
    return settings if settings.enabled else None


def adapter_bytes(rank: int, layer_shapes: Sequence[tuple[int, int]], bytes_per_number: int) -> int:
    """Bytes of one adapter: A is [rank, in], B is [out, rank] for every (out, in) target layer."""
    return sum(rank * (out + inp) for out, inp in layer_shapes) * bytes_per_number
