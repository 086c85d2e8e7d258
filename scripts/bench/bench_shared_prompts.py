"""trainer.share_prompts measured: one packed micro-batch of GRPO groups (several samples of each
prompt) through the trainer's own forward and backward (`sequence_logprobs`, a policy-gradient loss
of the same graph), plain packed row (the baseline) against the shared-prompt row with each of its
two attentions (`BranchLoopAttention`: one SDPA call per prefix and per branch, CPU's;
`BatchedBlockAttention`: two padded calls per layer, CUDA's), in the same run.

Per case: seconds per forward+backward (median of `--reps` after two warm-ups), peak memory above
the weights (CUDA: torch's allocator; CPU: not measured), the row's tokens, and the largest
log-prob difference between the two (what sharing must keep at the dtype's rounding). Random
weights of a committed model's shape (`rlhf_orch.memory.shapes.KNOWN_CONFIGS`); no DeepSpeed, no Ray.

Usage: python scripts/bench/bench_shared_prompts.py [--device cuda|cpu] [--model KEY] [--dtype bfloat16]
       [--cases PROMPTSxGROUPxPROMPT_LENxRESPONSE_LEN,...]   (prints a table and one JSON line)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from rlhf_orch.memory.shapes import KNOWN_CONFIGS
from rlhf_orch.trainer.forward import packed_attention_impl, sequence_logprobs
from rlhf_orch.trainer import shared_prompts
from rlhf_orch.trainer.shared_prompts import BatchedBlockAttention, BranchLoopAttention, shared_prompt_layout
from rlhf_orch.transfer.batch import PackedBatch, Sample

MODES = {"loop": BranchLoopAttention, "batched": BatchedBlockAttention}
GPU_CASES = "4x8x512x256,2x16x1024x512,8x4x256x1024,16x2x128x128"
CPU_CASES = "2x4x96x32,1x8x192x64"


def parse_case(text: str) -> tuple[int, int, int, int]:
    prompts, group, prompt_len, response_len = (int(x) for x in text.split("x"))
    return prompts, group, prompt_len, response_len


def micro_batch(vocab: int, prompts: int, group: int, prompt_len: int, response_len: int, device: str) -> PackedBatch:
    """`prompts` groups of `group` samples; response lengths spread over 50-100 % of `response_len`
    (a GRPO group's answers differ in length); groups interleaved, as the packer may order them."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(group):
        for p in range(prompts):
            length = max(1, response_len // 2 + (response_len // 2) * i // max(1, group - 1))
            samples.append((p, length))
    prompt_ids = [torch.randint(3, vocab, (prompt_len,), generator=g) for _ in range(prompts)]
    return PackedBatch.from_samples(
        [
            Sample(
                prompt_ids=prompt_ids[p],
                response_ids=torch.randint(3, vocab, (length,), generator=g),
                reward=1.0,
                index=k,
            )
            for k, (p, length) in enumerate(samples)
        ]
    ).to(device)


@contextlib.contextmanager
def forced(device_type: str, attention: type):
    """Shared-prompt rows on `device_type` run `attention`, at any saving (its threshold off);
    the registry and the threshold as they were afterwards."""
    registry = shared_prompts.ATTENTION_BY_DEVICE
    had, before, saving = device_type in registry, registry.get(device_type), attention.min_token_saving
    registry[device_type], attention.min_token_saving = attention, 0.0
    try:
        yield
    finally:
        attention.min_token_saving = saving
        if had:
            registry[device_type] = before
        else:
            registry.pop(device_type)


def shared_prompt_layout_tokens(mb: PackedBatch) -> int:
    """The shared row's length whatever the device's threshold."""
    with forced(mb.input_ids.device.type, BranchLoopAttention):
        layout = shared_prompt_layout(mb)
    return layout.num_tokens if layout is not None else mb.num_tokens


def timed_step(model, mb: PackedBatch, share: bool, device: str) -> tuple[float, torch.Tensor]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    logprobs = sequence_logprobs(model, mb, 1.0, share_prompts=share)
    mask = mb.action_mask.float()
    (-(logprobs * mask).sum() / mask.sum()).backward()
    sync()
    return time.perf_counter() - t0, logprobs.detach()


def measure(model, mb: PackedBatch, share: bool, device: str, reps: int) -> dict:
    for _ in range(2):
        timed_step(model, mb, share, device)
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, logprobs = [], None
    for _ in range(reps):
        seconds, logprobs = timed_step(model, mb, share, device)
        times.append(seconds)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device == "cuda" else None
    return {"step_s": statistics.median(times), "peak_gb": peak, "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model", default=None, help="a KNOWN_CONFIGS key (default: Qwen2.5-0.5B on cuda, SmolLM2-135M on cpu)"
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument(
        "--cases", default=None, help=f"PROMPTSxGROUPxPROMPT_LENxRESPONSE_LEN,... (cuda: {GPU_CASES}; cpu: {CPU_CASES})"
    )
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    model_key = args.model or ("Qwen/Qwen2.5-0.5B-Instruct" if cuda else "SmolLM2-135M-Instruct.Q4_1.gguf")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    cases = [parse_case(c) for c in (args.cases or (GPU_CASES if cuda else CPU_CASES)).split(",")]

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in KNOWN_CONFIGS[model_key].items() if k != "torch_dtype"}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=packed_attention_impl(args.device)).to(
            dtype
        )
    model.config.use_cache = False
    model.train()
    device_name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"{model_key} (random weights, {str(dtype).removeprefix('torch.')}) on {device_name}, "
        f"attention {model.config._attn_implementation}, torch {torch.__version__}"
    )

    rows = []
    print(
        f"{'case (prompts x group x prompt x response)':<44}{'tokens':>8}{'shared':>8}{'plain s':>9}{'loop s':>9}{'batched s':>10}"
        f"{'x loop':>8}{'x batched':>10}{'default':>9}{'plain GB':>10}{'loop GB':>9}{'batched GB':>11}{'max |dlogp|':>12}"
    )
    for prompts, group, prompt_len, response_len in cases:
        mb = micro_batch(config.vocab_size, prompts, group, prompt_len, response_len, args.device)
        layout = shared_prompt_layout(mb)  # None where the device's default runs the plain row
        shared_tokens = shared_prompt_layout_tokens(mb)
        scored = mb.action_mask.bool()
        plain = measure(model, mb, False, args.device, args.reps)
        row = {
            "case": f"{prompts}x{group}x{prompt_len}x{response_len}",
            "tokens": mb.num_tokens,
            "shared_tokens": shared_tokens,
            "plain_step_s": round(plain["step_s"], 4),
            "plain_peak_gb": None if plain["peak_gb"] is None else round(plain["peak_gb"], 3),
            "max_abs_logprob_diff": 0.0,
        }
        device_type = torch.device(args.device).type
        default = shared_prompts.ATTENTION_BY_DEVICE.get(device_type, BranchLoopAttention)
        row["default"] = next((m for m, a in MODES.items() if a is default), "?") if layout is not None else "plain"
        for mode, attention in MODES.items():  # each measured even where the default runs the plain row
            with forced(device_type, attention):
                shared = measure(model, mb, True, args.device, args.reps)
            row[f"{mode}_step_s"] = round(shared["step_s"], 4)
            row[f"speedup_{mode}"] = round(plain["step_s"] / shared["step_s"], 3)
            row[f"{mode}_peak_gb"] = None if shared["peak_gb"] is None else round(shared["peak_gb"], 3)
            diff = (plain["logprobs"][scored].float() - shared["logprobs"][scored].float()).abs().max().item()
            row["max_abs_logprob_diff"] = max(row["max_abs_logprob_diff"], diff)
        rows.append(row)

        def gb(v, w):
            return f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"

        print(
            f"{row['case']:<44}{row['tokens']:>8}{row['shared_tokens']:>8}{row['plain_step_s']:>9.3f}{row['loop_step_s']:>9.3f}"
            f"{row['batched_step_s']:>10.3f}{row['speedup_loop']:>8.2f}{row['speedup_batched']:>10.2f}{row['default']:>9}"
            f"{gb(row['plain_peak_gb'], 10)}{gb(row['loop_peak_gb'], 9)}{gb(row['batched_peak_gb'], 11)}"
            f"{row['max_abs_logprob_diff']:>12.2e}"
        )
        del mb, layout, plain, shared
    print(
        json.dumps(
            {
                "bench": "shared_prompts",
                "device": device_name,
                "model": model_key,
                "dtype": str(dtype).removeprefix("torch."),
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "rows": rows,
                **{
                    f"{k}_{mode}": f(r[f"speedup_{mode}"] for r in rows)
                    for mode in MODES
                    for k, f in (("min_speedup", min), ("max_speedup", max))
                },
            }
        )
    )


if __name__ == "__main__":
    main()
