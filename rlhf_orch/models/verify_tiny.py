"""Check that the tiny model loads and samples in vLLM, and measure its initial reward.

Run: VLLM_CPU_KVCACHE_SPACE=1 python -m rlhf_orch.models.verify_tiny

Samples the default data config's step-0 prompts (32 prompts x 4 samples, temperature 1, no top-k /
top-p, like PPO's rollouts) with vLLM and with transformers, scores them with the task's rule, and
prints both mean rewards: the PPO starting point, cross-checked across the two samplers.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import fields

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_orch.models.options import TinyModelConfig
from rlhf_orch.data.digit_task import DigitReverseTask, Prompt, reward_fn
from rlhf_orch.models.tiny import TinyLlama
from rlhf_orch.models.warm_start_task import default_warm_start_task


def evaluation_prompts(task: DigitReverseTask, num_prompts: int, samples_per_prompt: int) -> list[Prompt]:
    """Step-0 prompts, each repeated `samples_per_prompt` times (as a PPO rollout batch is)."""
    return [p for p in task.batch(num_prompts, 0) for _ in range(samples_per_prompt)]


def hf_mean_reward(path: str, prompts: list[Prompt], max_new_tokens: int, seed: int) -> float:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # generation appends on the right
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    encoded = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    responses = tokenizer.batch_decode(output[:, encoded.input_ids.shape[1] :], skip_special_tokens=True)
    return sum(reward_fn(prompts, responses)) / len(prompts)


def vllm_mean_reward(
    path: str, prompts: list[Prompt], max_new_tokens: int, max_model_len: int, seed: int
) -> tuple[float, list[str]]:
    from vllm import LLM, SamplingParams  # imported late: it is heavy and starts worker processes

    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=seed)
    # No per-request seed: it would make the repeated prompts' samples identical.
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_new_tokens)
    outputs = llm.generate([p.text for p in prompts], params)
    responses = [o.outputs[0].text for o in outputs]
    return sum(reward_fn(prompts, responses)) / len(prompts), responses


def _default_cache_dir() -> str:
    return os.environ.get("RLHF_ORCH_CACHE", os.path.expanduser("~/.cache/rlhf_orch"))


def main() -> None:
    defaults = TinyModelConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=_default_cache_dir())
    parser.add_argument("--context-len", type=int, default=8192, help="as conf/model/tiny.yaml")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_kwargs = {
        f.name: getattr(defaults, f.name)
        for f in fields(TinyModelConfig)
        if f.name not in ("_target_", "cache_dir", "context_len", "warmup_steps")
    }
    model = TinyLlama(
        context_len=args.context_len, warmup_steps=args.warmup_steps, cache_dir=args.cache_dir, **model_kwargs
    )
    started = time.perf_counter()
    path = model.path()
    print(f"model {model.model_id} at {path} ready in {time.perf_counter() - started:.1f}s")

    task = default_warm_start_task()
    prompts = evaluation_prompts(task, args.num_prompts, args.samples_per_prompt)
    max_model_len = task.prompt_max_len + task.response_max_len

    vllm_reward, responses = vllm_mean_reward(path, prompts, task.response_max_len, max_model_len, args.seed)
    for prompt, response in list(zip(prompts, responses))[:8]:
        print(f"  {prompt.text!r:>24} -> {response!r:<16} (want {prompt.label!r})")
    hf_reward = hf_mean_reward(path, prompts, task.response_max_len, args.seed)
    print(f"initial mean reward over {len(prompts)} samples: vLLM {vllm_reward:.3f}, HF {hf_reward:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
