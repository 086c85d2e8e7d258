"""What determines the tiny policy's checkpoint (its shape and its warm-start recipe), apart from
building it: plain dataclasses, so that naming the checkpoint (`rlhf_orch.models.tiny.TinyLlama.path`,
a hash of these) imports neither torch nor transformers (a process that only names the checkpoint
pays for neither). The build itself is `rlhf_orch.models.tiny_build`."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_orch.models.cache import BUILD_THREADS

# vLLM's CPU attention kernels reject smaller heads.
MIN_HEAD_DIM = 32


@dataclass(frozen=True)
class WarmStartRecipe:
    """Supervised warm start hyper-parameters. Part of the cache key: change one, get a new model.

    The warm start has two phases over its `warmup_steps` AdamW steps:

    1. clean (the first 1 - noisy_fraction of the steps, at `lr`): exact demonstrations teach the
       copy-in-reverse mechanism and the answer length;
    2. noisy (the rest, at `noisy_lr`): demonstrations whose digits are each replaced by a random
       digit with probability `answer_noise`. The mechanism stays, but the policy becomes unsure:
       at temperature 1 it writes the right digit only about half the time.

    Why not simply stop a clean warm start early: an early-stopped model lacks the mechanism, and
    policy-gradient steps at PPO's learning rate barely move it (measured with an HF-sampled
    REINFORCE loop: mean reward 0.32 -> 0.35 over 30 steps of 32x4 at lr 1e-4). A policy that knows
    the mechanism but is unsure of it is the situation RL is good at (sharpening a behaviour already
    in the sample distribution): from this recipe with warmup_steps=150, a PPO loop with PPOConfig's
    defaults (critic, GAE, k1 KL 0.01, actor lr 1e-4) went 0.32 -> 0.73 in 30 steps. With the
    long-context batches below the initial reward is ~0.24 and `python run.py` goes 0.26 -> 0.58
    in 100 steps (docs/benchmarks.md).
    """

    lr: float = 3e-3
    noisy_lr: float = 1e-3
    noisy_fraction: float = 1 / 3
    answer_noise: float = 0.6
    batch_size: int = 128
    tokenizer_corpus_size: int = 2000
    init_seed: int = 0
    # Every `long_context_every`-th step also trains on a small batch of prompts with this many
    # filler tokens in front (the `data=long8k` layout): without it the model has never seen
    # positions past ~20, ignores its EOS at long context and generates to the 7168-token cap.
    long_context_every: int = 10
    long_context_batch: int = 8
    long_context_filler: int = 960
    threads: int = BUILD_THREADS

    def phases(self, steps: int) -> list[tuple[int, float, float]]:
        """(steps, learning rate, answer noise) of each phase, for `steps` steps in all."""
        noisy_steps = round(steps * self.noisy_fraction)
        return [(steps - noisy_steps, self.lr, 0.0), (noisy_steps, self.noisy_lr, self.answer_noise)]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Everything that determines the built checkpoint (besides the task and the recipe)."""

    context_len: int
    dtype: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    warmup_steps: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.head_dim < MIN_HEAD_DIM:
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.head_dim} < {MIN_HEAD_DIM}: "
                "vLLM's CPU attention does not support it; use fewer heads or a larger hidden size"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
