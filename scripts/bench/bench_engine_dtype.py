"""The engine's dtype measured: a vLLM engine of the real model in float32 (the baseline: what the
trainers compute in on CPU) against the same engine in bfloat16, each in a process of its own, on
the prompts and sampling of `experiment=smollm2_arith` (reasoning-gym sums with two solved examples,
4 prompts x 8 samples, temperature 1, the experiment's engine threads), every response `--tokens` long.

Per dtype: the engine's start (seconds to a built `vllm.LLM`), generation seconds per rollout
(median of `--reps` after one warm-up), tokens/s, the engine process's peak RSS, and the log-prob
mismatch the trainers would see: the engine's log-prob of each sampled token against a float32
Hugging Face forward of the same sequences (what the policy's old log-probs are), mean and max
absolute difference in nats (the engine-vs-trainer gap that truncated importance sampling corrects).
The CPU's bfloat16 instructions are printed with the table: without AVX512-BF16 or AMX, bfloat16
matrix products run through float32 conversion.

Usage: python scripts/bench/bench_engine_dtype.py [--model smollm2_135m] [--tokens 64] [--reps 2]
       (prints a table and one JSON line; ~4 min on the 2-core CPU machine)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

DTYPES = ("float32", "bfloat16")  # the baseline first


def cpu_bf16_flags() -> list[str]:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def shared_inputs(model: str, tokens: int) -> dict:
    """The model's checkpoint, the first rollout's prompts of the experiment, the sampling settings."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smollm2_arith", f"model={model}"])
    built = instantiate(cfg.model)
    task = instantiate(cfg.data)
    task.bind(built.tokenizer())
    prompts = task.sample_prompts(cfg.algo.rollout_batch_size)
    return {
        "model_path": built.path(),
        "prompts": [list(p.prompt_ids) for p in prompts],
        "samples": int(cfg.algo.samples_per_prompt),
        "temperature": float(cfg.algo.temperature),
        "tokens": tokens,
        "max_model_len": int(cfg.data.prompt_max_len + tokens),
        "threads": int(cfg.engine.torch_threads),  # the experiment's engine.torch_threads
    }


def engine_run(spec: dict, dtype: str, reps: int) -> dict:
    """(Its own process.) Build the engine, generate the rollout `reps` + 1 times (the first is warm-up)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.compiler.set_stance("force_eager")  # as rlhf_orch's eager CPU engines
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model_path"],
        dtype=dtype,
        max_model_len=spec["max_model_len"],
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=32,
        kv_cache_memory_bytes=512 * 2**20,
        # The model's own distribution: processed log-probs would renormalise over what min_tokens
        # masks (the end-of-sequence token), a gap no dtype causes.
        logprobs_mode="raw_logprobs",
    )
    start_s = time.perf_counter() - t0
    params = SamplingParams(
        n=spec["samples"],
        max_tokens=spec["tokens"],
        min_tokens=spec["tokens"],
        temperature=spec["temperature"],
        logprobs=0,
        seed=0,
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    times, outputs = [], None
    for _ in range(reps + 1):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    sequences = [
        {
            "prompt": list(o.prompt_token_ids),
            "tokens": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
        }
        for o in outputs
        for c in o.outputs
    ]
    generated = sum(len(s["tokens"]) for s in sequences)
    return {
        "dtype": dtype,
        "start_s": start_s,
        "gen_s": statistics.median(times[1:]),
        "tokens_per_s": generated / statistics.median(times[1:]),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "sequences": sequences,
    }


def trainer_mismatch(model_path: str, sequences: list[dict]) -> tuple[float, float]:
    """Mean and max |engine log-prob - float32 forward's| over every sampled token (both untempered)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    diffs: list[float] = []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor([s["prompt"] + s["tokens"]])
            logits = model(ids).logits[0, len(s["prompt"]) - 1 : -1].float()
            ours = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(s["tokens"])[:, None])[:, 0]
            diffs += (ours - torch.tensor(s["logprobs"])).abs().tolist()
    return statistics.fmean(diffs), max(diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--_engine", nargs=2, metavar=("SPEC", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._engine:  # the child: one engine, one JSON line
        spec = json.loads(Path(args._engine[0]).read_text())
        print("RESULT " + json.dumps(engine_run(spec, args._engine[1], args.reps)), flush=True)
        return
    import tempfile

    spec = shared_inputs(args.model, args.tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        # bfloat16 first: the first process pays the cold file cache in its start, not the baseline.
        for dtype in reversed(DTYPES):
            out = subprocess.run(
                [sys.executable, __file__, "--reps", str(args.reps), "--_engine", str(spec_path), dtype],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])},  # what the run's engine gets
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
                rows.append({"dtype": dtype, "error": " | ".join(tail)})
                continue
            row = json.loads(line.removeprefix("RESULT "))
            row["mismatch_mean"], row["mismatch_max"] = trainer_mismatch(spec["model_path"], row.pop("sequences"))
            rows.append(row)
    flags = cpu_bf16_flags()
    print(f"\n{args.model}: {len(spec['prompts'])} prompts x {spec['samples']} samples x {args.tokens} tokens; "
          f"CPU bfloat16 instructions: {', '.join(flags) or 'none (no AVX512-BF16, no AMX)'}")  # fmt: skip
    print(
        f"{'engine dtype':<13}{'start s':>9}{'gen s':>9}{'tok/s':>9}{'peak RSS GB':>13}{'|dlogp| mean':>14}{'max':>9}"
    )
    for r in sorted(rows, key=lambda r: DTYPES.index(r["dtype"])):
        if "error" in r:
            print(f"{r['dtype']:<13} failed: {r['error'][:200]}")
            continue
        print(
            f"{r['dtype']:<13}{r['start_s']:>9.1f}{r['gen_s']:>9.2f}{r['tokens_per_s']:>9.0f}{r['peak_rss_gb']:>13.2f}"
            f"{r['mismatch_mean']:>14.2e}{r['mismatch_max']:>9.3f}"
        )
    by = {r["dtype"]: r for r in rows if "error" not in r}
    result = {"model": args.model, "tokens": args.tokens, "cpu_bf16_flags": flags}
    for dtype, r in by.items():
        for key in ("gen_s", "start_s", "peak_rss_gb", "mismatch_mean", "mismatch_max"):
            result[f"{key}_{dtype}"] = round(r[key], 6 if key.startswith("mismatch") else 3)
    if "float32" in by and "bfloat16" in by:
        result["bf16_speedup"] = round(by["float32"]["gen_s"] / by["bfloat16"]["gen_s"], 3)
    result["errors"] = {r["dtype"]: r["error"] for r in rows if "error" in r}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
