"""The tiny local policy: built on first use, cached by content, shared safely between processes
(`rlhf_orch.models.cache.build_once`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlhf_orch.models.base import ModelSource
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.models.cache import build_once
from rlhf_orch.models.options import TinyModelConfig
from rlhf_orch.models.tiny_spec import TinyLlamaSpec, WarmStartRecipe
from rlhf_orch.models.warm_start_task import WARM_STARTS

# Bumped when the build procedure changes in a way the spec, recipe and task do not capture.
BUILD_FORMAT_VERSION = 4  # 2: model vocabulary = tokenizer size; 3: chat template; 4: it renders conversations


def build_tiny_checkpoint(out_dir: Path, spec: TinyLlamaSpec, task: Any, recipe: WarmStartRecipe) -> None:
    """`rlhf_orch.models.tiny_build.build_tiny_checkpoint`, imported when a build is due: torch and
    transformers come with it, and a cached checkpoint's path is named without them."""
    from rlhf_orch.models.tiny_build import build_tiny_checkpoint as build

    build(out_dir, spec, task, recipe)


class TinyLlama(ModelSource):
    """A small Llama with a locally trained BPE tokenizer, warm-started on the digit task."""

    def __init__(
        self,
        context_len: int,
        dtype: str,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        intermediate_size: int,
        vocab_size: int,
        warmup_steps: int,
        cache_dir: str,
        warm_start: str = TinyModelConfig.warm_start,
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__(context_len, dtype, lora)
        self.spec = TinyLlamaSpec(
            context_len=context_len,
            dtype=dtype,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            warmup_steps=warmup_steps,
        )
        self.spec.validate()  # fail at instantiate time, not inside a remote actor
        if warm_start not in WARM_STARTS:
            raise ValueError(f"model.warm_start={warm_start!r}: one of {', '.join(WARM_STARTS)}")
        make_task, self.recipe = WARM_STARTS[warm_start]
        self.task = make_task()
        self.cache_dir = Path(cache_dir).expanduser()

    @property
    def cache_key(self) -> str:
        """Hash of everything the checkpoint depends on."""
        identity = {
            "build_format_version": BUILD_FORMAT_VERSION,
            "spec": asdict(self.spec),
            "recipe": asdict(self.recipe),
            "task": self.task.definition(),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def model_id(self) -> str:
        return f"tiny-llama-{self.cache_key}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.cache_dir / self.model_id

    def path(self) -> str:
        """The checkpoint directory, built first if no process has built it yet."""
        return build_once(
            self.cache_dir,
            self.model_id,
            lambda staging: build_tiny_checkpoint(staging, self.spec, self.task, self.recipe),
        )

    def reward_model_path(self) -> str:
        """The tiny reward model for this policy (`reward=model` with no model_path), built on first use."""
        from rlhf_orch.models.tiny_reward import tiny_reward_model_path

        return tiny_reward_model_path(self.path(), self.cache_dir)
