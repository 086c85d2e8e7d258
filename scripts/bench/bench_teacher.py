"""Where a teacher should score the student's samples, measured: the trainer-side forward the run
uses (`rlhf_orch.trainer.frozen_models.frozen_logprobs` over the packed micro-batches of the
transfer, in the reference rank's process) against a vLLM engine's prompt log-probs of the same
sequences (`SamplingParams(prompt_logprobs=0, max_tokens=1)`, the engine's `prompt_logprobs`).

The sequences are those of `experiment=smollm2_distill`: reasoning-gym prompts with the student's
samples (`model=smollm2_student`, sampled by a vLLM engine of the student), scored by the teacher
(`teacher=smollm2_135m`). Per way: its start (seconds to a loaded model / a built `vllm.LLM`),
its scoring seconds per rollout (median of `--reps` after a warm-up), its peak RSS, and how far its
log-probs are from the trainer-side forward's (mean and max |difference| in nats over the response
tokens: the vLLM way's log-probs would enter the advantages in their place). Each way runs in a
process of its own with the same threads.

Usage: python scripts/bench/bench_teacher.py [--prompts 8] [--samples 4] [--tokens 32] [--reps 2]
       (prints a table and one JSON line; ~3 min on the 2-core CPU machine)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

WAYS = ("trainer_forward", "vllm_prompt_logprobs")  # the run's way first


def experiment():
    """`experiment=smollm2_distill`, composed."""
    from hydra import compose, initialize_config_dir

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=smollm2_distill"])


def rollout(prompts: int, samples: int, tokens: int) -> dict:
    """The teacher's checkpoint and the student's samples of the experiment's first prompts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from hydra.utils import instantiate

    cfg = experiment()
    student, teacher = instantiate(cfg.model), instantiate(cfg.teacher)
    task = instantiate(cfg.data)
    task.bind(student.tokenizer())
    prompt_ids = [list(p.prompt_ids) for p in task.sample_prompts(prompts)]
    import torch

    torch.compiler.set_stance("force_eager")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=student.path(), dtype="float32", max_model_len=cfg.data.prompt_max_len + tokens, seed=0,
              enforce_eager=True, kv_cache_memory_bytes=512 * 2**20)  # fmt: skip
    params = SamplingParams(n=samples, max_tokens=tokens, min_tokens=tokens, temperature=1.0, seed=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    sequences = [{"prompt": list(o.prompt_token_ids), "response": list(c.token_ids)} for o in outs for c in o.outputs]
    return {"teacher": teacher.path(), "max_model_len": cfg.data.prompt_max_len + tokens, "sequences": sequences,
            "threads": int(cfg.trainer.torch_threads), "micro_batch_size": int(cfg.algo.micro_batch_size)}  # fmt: skip


def trainer_forward(spec: dict, reps: int) -> dict:
    """(Its own process.) The teacher as the reference rank holds it, scoring packed micro-batches."""
    import torch
    from hydra.utils import instantiate

    from rlhf_orch.liveness import WorkCount
    from rlhf_orch.trainer.forward import load_policy, sequence_logprobs
    from rlhf_orch.trainer.frozen_models import frozen
    from rlhf_orch.trainer.token_weighting import rows_for_targets
    from rlhf_orch.transfer.batch import Sample

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = frozen(load_policy(spec["teacher"], "float32", torch.device("cpu")))
    start_s = time.perf_counter() - t0
    samples = [Sample(s["prompt"], s["response"], 0.0, index=i) for i, s in enumerate(spec["sequences"])]
    transfer = instantiate(experiment().transfer)
    (shard,) = transfer.layout(samples, 1, spec["micro_batch_size"], 0)
    times, logprobs = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        with torch.no_grad():
            logprobs = [sequence_logprobs(model, mb, 1.0, True) for mb in WorkCount().each(shard)]
        times.append(time.perf_counter() - t)
    per_sample: dict[int, list[float]] = {}
    for rows in rows_for_targets(shard, {"lp": logprobs}, 0):  # back per sample: its response tokens
        for k, index in enumerate(rows.indices.tolist()):
            per_sample[int(index)] = rows.fields["lp"][k][rows.action_mask[k].bool()].tolist()
    return {"start_s": start_s, "score_s": statistics.median(times[1:]), "logprobs": per_sample}


def vllm_prompt_logprobs(spec: dict, reps: int) -> dict:
    """(Its own process.) A vLLM engine of the teacher, each whole sequence as a prompt."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.compiler.set_stance("force_eager")  # as rlhf_orch's eager CPU engines
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["teacher"], dtype="float32", max_model_len=spec["max_model_len"], seed=0, enforce_eager=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=512 * 2**20, logprobs_mode="raw_logprobs")  # fmt: skip
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=s["prompt"] + s["response"]) for s in spec["sequences"]]
    times, outs = [], []
    for _ in range(reps + 1):
        llm.reset_prefix_cache()  # (the samples of a prompt share it within one call, as a rollout's do)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    per_sample = {}
    for i, (s, o) in enumerate(zip(spec["sequences"], outs)):
        start = len(s["prompt"])
        per_sample[i] = [o.prompt_logprobs[start + k][tok].logprob for k, tok in enumerate(s["response"])]
    return {"start_s": start_s, "score_s": statistics.median(times[1:]), "logprobs": per_sample}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--_way", nargs=2, metavar=("SPEC", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._way:  # the child: one way, one JSON line
        spec = json.loads(Path(args._way[0]).read_text())
        row = globals()[args._way[1]](spec, args.reps)
        row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print("RESULT " + json.dumps(row), flush=True)
        return
    spec = rollout(args.prompts, args.samples, args.tokens)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for way in reversed(WAYS):  # (the first process pays the cold file cache: not the baseline)
            out = subprocess.run(
                [sys.executable, __file__, "--reps", str(args.reps), "--_way", str(spec_path), way],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONPATH": str(REPO)},
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                rows[way] = {"error": " | ".join((out.stderr or out.stdout).strip().splitlines()[-3:])}
                continue
            rows[way] = json.loads(line.removeprefix("RESULT "))
    base = rows.get(WAYS[0], {}).get("logprobs")
    tokens = sum(len(s["response"]) for s in spec["sequences"])
    print(f"\nteacher smollm2_135m scoring {len(spec['sequences'])} student samples x {args.tokens} tokens "
          f"({tokens} response tokens), {spec['threads']} threads")  # fmt: skip
    print(f"{'way':<22}{'start s':>9}{'score s':>9}{'tok/s':>9}{'peak RSS GB':>13}{'|dlogp| mean':>14}{'max':>9}")
    result = {"sequences": len(spec["sequences"]), "response_tokens": tokens, "threads": spec["threads"]}
    for way in WAYS:
        r = rows.get(way, {"error": "not run"})
        if "error" in r:
            print(f"{way:<22} failed: {r['error'][:200]}")
            result[f"error_{way}"] = r["error"]
            continue
        diffs = [abs(a - b) for k, v in r["logprobs"].items() for a, b in zip(v, base[k])] if base else [0.0]
        r["diff_mean"], r["diff_max"] = statistics.fmean(diffs), max(diffs)
        print(f"{way:<22}{r['start_s']:>9.1f}{r['score_s']:>9.2f}{tokens / r['score_s']:>9.0f}{r['peak_rss_gb']:>13.2f}"
              f"{r['diff_mean']:>14.2e}{r['diff_max']:>9.3f}")  # fmt: skip
        for key in ("start_s", "score_s", "peak_rss_gb", "diff_mean", "diff_max"):
            result[f"{key}_{way}"] = round(r[key], 6 if key.startswith("diff") else 3)
    if all("error" not in rows.get(w, {"error": 1}) for w in WAYS):
        result["vllm_speedup"] = round(rows[WAYS[0]]["score_s"] / rows[WAYS[1]]["score_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
