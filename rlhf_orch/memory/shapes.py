"""A model's shape as the memory plan needs it, read from its own `config.json`.

The checkpoint says how many layers, how wide, how many (KV) heads and how large a vocabulary it
has; the plan asks the user none of that. A hub id that is not on this machine (planning a cluster
from a laptop) falls back to `KNOWN_CONFIGS`: the `config.json` fields of the models that
`conf/model/` names, copied from their published configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

#: The fields of the published `config.json` of every hub model `conf/model/` names.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2",
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-3B": dict(
        model_type="qwen2",
        num_hidden_layers=36,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=2,
        intermediate_size=11008,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-Math-7B": dict(
        model_type="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2-7B-Instruct": dict(
        model_type="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-32B": dict(
        model_type="qwen2",
        num_hidden_layers=64,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=27648,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        model_type="qwen2",
        num_hidden_layers=28,
        hidden_size=1536,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "meta-llama/Meta-Llama-3-8B": dict(
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
# Fine-tunes keep their base model's shape.
# Packaged GGUF models (model=smollm2_135m), keyed by the file's name: the checkpoint built from it
# (rlhf_orch.models.gguf) is float32, with the release's config.json fields.
KNOWN_CONFIGS["SmolLM2-135M-Instruct.Q4_1.gguf"] = dict(
    model_type="llama",
    num_hidden_layers=30,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    torch_dtype="float32",
)
KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B-Instruct"] = KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B"]
KNOWN_CONFIGS["OpenRLHF/Llama-3-8b-sft-mixture"] = KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B"]
KNOWN_CONFIGS["OpenRLHF/Llama-3-8b-rm-mixture"] = KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B"]

# Families whose attention projections q, k, v carry a bias (Qwen2 does, Llama does not).
_QKV_BIAS_TYPES = ("qwen2",)


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    checkpoint_bytes_per_param: int = 2  # the dtype the weights are stored in (config.json's torch_dtype)
    tokenizer_file_bytes: int = 0  # size of the checkpoint's tokenizer files, where they are on this machine

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") in _QKV_BIAS_TYPES)),
            checkpoint_bytes_per_param=4
            if str(config.get("torch_dtype") or config.get("dtype") or "bfloat16") == "float32"
            else 2,
        )

    # ---- parameter counts (elements)
    @property
    def linear_params(self) -> int:
        """Parameters of the layers' linear projections (what vLLM's CPU backend re-packs)."""
        return self.layers * (self.layer_params - 2 * self.hidden)

    @property
    def layer_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # SwiGLU MLP, two norms

    @property
    def backbone_params(self) -> int:
        """Embedding, every layer and the final norm: what every role's model holds."""
        return self.vocab * self.hidden + self.layers * self.layer_params + self.hidden

    @property
    def policy_params(self) -> int:
        return self.backbone_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def critic_params(self) -> int:
        return self.backbone_params + self.hidden + 1  # the value head replaces the LM head

    @property
    def reward_params(self) -> int:
        return self.backbone_params + self.hidden  # a sequence-classification score head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear projection of one layer, by the name HF's Llama/Qwen2 give it."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (q_out, h),
            "k_proj": (kv_out, h),
            "v_proj": (kv_out, h),
            "o_proj": (h, q_out),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def lora_params(self, rank: int, targets: Any) -> int:
        """Parameters of rank-`rank` LoRA adapters on the targeted projections of every layer
        ("all-linear": all seven; A is rank x in, B is out x rank)."""
        shapes = self.linear_shapes()
        names = shapes if isinstance(targets, str) else [t for t in targets if t in shapes]
        return self.layers * sum(rank * sum(shapes[n]) for n in names)

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV cache of one token over all layers (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element


def shape_of(model_cfg: Any) -> tuple[Optional[ModelShape], str]:
    """(the shape, where it was read) of the configured model, or (None, why not).

    The tiny model's shape is its config; a Hugging Face checkpoint's is its `config.json`, from
    the local directory or the local Hugging Face cache, else from `KNOWN_CONFIGS`.
    """
    if hasattr(model_cfg, "num_layers"):  # model=tiny: built from these fields (rlhf_orch.models.tiny_build)
        return ModelShape(
            layers=model_cfg.num_layers,
            hidden=model_cfg.hidden_size,
            heads=model_cfg.num_heads,
            kv_heads=model_cfg.num_heads,
            head_dim=model_cfg.hidden_size // model_cfg.num_heads,
            intermediate=model_cfg.intermediate_size,
            vocab=model_cfg.vocab_size,
            tied_embeddings=True,
            checkpoint_bytes_per_param=4,  # saved in float32 (rlhf_orch.models.tiny_build)
        ), "model config"
    gguf_file = getattr(model_cfg, "gguf_file", None)
    if isinstance(gguf_file, str):  # a packaged model: its built checkpoint, else its known config
        from rlhf_orch.models.packaged import packaged_model_dir

        built = packaged_model_dir(model_cfg) / "config.json"
        if built.is_file():
            return _local_shape(built), str(built)
        whole = packaged_model_dir(model_cfg, whole=True) / "config.json"
        if whole.is_file():
            shape, where = _local_shape(whole), str(whole)
        elif Path(gguf_file).name in KNOWN_CONFIGS:
            shape = ModelShape.from_config(KNOWN_CONFIGS[Path(gguf_file).name])
            where = f"published config of {Path(gguf_file).name}"
        else:
            return None, f"{gguf_file} is not built yet"
        layers = getattr(model_cfg, "layers", None)
        if layers is None:
            return shape, where
        return replace(shape, layers=layers), f"{where}, first {layers} layers"  # a student of it
    name = getattr(model_cfg, "name_or_path", None)
    if not isinstance(name, str):
        return None, "the model option names no checkpoint"
    return checkpoint_shape(name)


def checkpoint_shape(name_or_path: str) -> tuple[Optional[ModelShape], str]:
    from rlhf_orch.models.hub import ModelSourceError, resolve_local_checkpoint

    try:
        local = Path(resolve_local_checkpoint(name_or_path, "model.name_or_path")) / "config.json"
        return _local_shape(local), str(local)
    except (ModelSourceError, OSError, KeyError, ValueError):
        pass
    if name_or_path in KNOWN_CONFIGS:
        return ModelShape.from_config(KNOWN_CONFIGS[name_or_path]), f"published config.json of {name_or_path}"
    return None, f"no config.json for model.name_or_path={name_or_path!r} on this machine"


#: The files a tokenizer is loaded from (fast tokenizers' tokenizer.json, slow ones' vocabulary and merges).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def _local_shape(config_json: Path) -> ModelShape:
    """The shape of a checkpoint on this machine, with the size of its tokenizer files."""
    shape = ModelShape.from_config(_text_config(json.loads(config_json.read_text())))
    fast = config_json.parent / "tokenizer.json"  # what a fast tokenizer loads, where it exists
    files = [fast] if fast.is_file() else [config_json.parent / name for name in TOKENIZER_FILES]
    return replace(shape, tokenizer_file_bytes=sum(f.stat().st_size for f in files if f.is_file()))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints keep the language model's fields under `text_config`."""
    return config.get("text_config", config) if "num_hidden_layers" not in config else config
