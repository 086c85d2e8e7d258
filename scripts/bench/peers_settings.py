"""The comparison's settings per model and our configurations (`scripts/bench/bench_peers.py`):
what each model and setting runs, our fastest configuration per setting, and what `--search` tries."""

from __future__ import annotations

from typing import Any

HELD_OUT = ["eval.before_train=true", "eval.temperature=1.0"]
# Per model: its base overrides, the JSON keys' infix, and per setting the steps and the held-out
# evaluation (prompts; before training, every `eval_every` steps and after the last).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "base": ["algo=grpo"],
        "key": "",
        "label": "tiny model, digit task",
        "settings": {
            "default": {
                "overrides": [],
                "steps": 30,
                "eval_every": 10,
                "eval": ["eval.num_prompts=64", "eval.samples_per_prompt=4"],
            },
            "generation_heavy": {
                "overrides": ["algo.min_response_len=256", "data.response_max_len=256"],
                "steps": 8,
                "eval_every": 8,
                "eval": ["eval.num_prompts=32", "eval.samples_per_prompt=4"],
            },
        },
    },
    "smollm2_135m": {
        "base": ["experiment=smollm2_arith"],
        "key": "real_",
        "label": "SmolLM2-135M-Instruct, reasoning-gym sums",
        "settings": {
            # The experiment's own evaluation: 64 held-out prompts x 4 samples, every 7 steps.
            "default": {"overrides": [], "steps": 14, "eval_every": 7, "eval": ["eval.samples_per_prompt=4"]},
            # Micro-batches of 8 (TRL: per-device batch 8, 4 accumulation steps): 16 x 448 tokens
            # do not fit this 24 GB host's memory plan beside the engine.
            "generation_heavy": {
                "overrides": ["algo.min_response_len=256", "data.response_max_len=256", "algo.micro_batch_size=8"],
                "steps": 3,
                "eval_every": 3,
                "eval": ["eval.num_prompts=32", "eval.samples_per_prompt=2"],
            },
        },
    },
}
# Our fastest configuration per model and setting on this machine (2 cores), from `--search`
# (docs/benchmarks.md has the search's figures); `identical` is always pipeline=sync.
OURS_BEST: dict[str, dict[str, list[str]]] = {
    "tiny": {
        "default": ["pipeline=async", "trainer.torch_threads=1", "algo.tis_cap=2.0"],
        "generation_heavy": ["pipeline=one_step_off", "trainer.torch_threads=1", "algo.tis_cap=2.0"],
    },
    "smollm2_135m": {
        # (the experiment's engine.torch_threads=2: under sync the engine and the trainer alternate)
        "default": ["pipeline=sync", "trainer.torch_threads=2"],
        # one_step_off overlaps them: the engine keeps its one core (2 + 2 threads on 2 cores slow both)
        "generation_heavy": [
            "pipeline=one_step_off",
            "trainer.torch_threads=2",
            "engine.torch_threads=1",
            "algo.tis_cap=2.0",
        ],
    },
}
# What --search tries (each for --search-steps steps, one seed).
SEARCH: dict[str, list[str]] = {  # (threads: Ray gives each actor one core; sync leaves the other role's idle)
    "sync, trainer 1 thread": ["pipeline=sync", "trainer.torch_threads=1"],
    "sync, trainer 2 threads": ["pipeline=sync", "trainer.torch_threads=2"],
    "one_step_off, trainer 1 thread": [
        "pipeline=one_step_off",
        "trainer.torch_threads=1",
        "engine.torch_threads=1",
        "algo.tis_cap=2.0",
    ],
    "one_step_off, trainer 2 threads": [
        "pipeline=one_step_off",
        "trainer.torch_threads=2",
        "engine.torch_threads=1",
        "algo.tis_cap=2.0",
    ],
    # TRL's GRPOConfig recomputes activations by default (gradient_checkpointing=True): memory for compute
    "one_step_off, trainer 2 threads, gradient checkpointing": [
        "pipeline=one_step_off",
        "trainer.torch_threads=2",
        "engine.torch_threads=1",
        "algo.tis_cap=2.0",
        "trainer.gradient_checkpointing=true",
    ],
    "async (staleness 1), trainer 1 thread": [
        "pipeline=async",
        "trainer.torch_threads=1",
        "engine.torch_threads=1",
        "algo.tis_cap=2.0",
    ],
    # async as it ran before prefix caching was kept on under it (each sample computes the prompt)
    "async (staleness 1), trainer 1 thread, no prefix caching": [
        "pipeline=async",
        "trainer.torch_threads=1",
        "engine.torch_threads=1",
        "algo.tis_cap=2.0",
        "engine.enable_prefix_caching=false",
    ],
}
