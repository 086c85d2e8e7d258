"""A trained role of one rank under ZeRO-2 against DeepSpeed's stage 0 (what `zero_stage_to_run`
gives it): the policy process's memory and step time, and whether the updates are the same.

Per stage, in a process of its own (world of one, gloo, as a trainer actor): SmolLM2-135M-Instruct in
float32 wrapped by `trainer/training_engine.py` as the policy actor builds it (AdamW), then `--steps`
optimizer steps of 2 accumulated micro-batches of 4 x 256 token ids (fixed random ids, language-model
loss). Reported: resident memory after `deepspeed.initialize`, the process's peak RSS, seconds per
optimizer step (after the first), and the largest difference of any parameter after the steps
between the two stages (the claim: the same update, bit for bit or within float rounding).

Usage: python scripts/bench/bench_one_rank_zero.py [--model smollm2_135m] [--steps 3]
       (prints a table and one JSON line; ~2 min on the 2-core CPU machine)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STAGES = (2, 0)  # trainer.zero_stage as configured (conf/config.yaml), then what one rank runs now
MICRO_BATCH, ACCUMULATION, SEQ_LEN = 4, 2, 256


def model_path(model: str) -> str:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}"])
    return instantiate(cfg.model).path()


def rss_gb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def one_stage(path: str, stage: int, steps: int, params_out: str) -> dict:
    """(Its own process.) One rank's DeepSpeed engine at `stage`, `steps` optimizer steps."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    import deepspeed

    from rlhf_orch.liveness import WorkCount
    from rlhf_orch.trainer.deepspeed_startup import skip_shm_comm_op
    from rlhf_orch.trainer.forward import load_policy
    from rlhf_orch.trainer.spec import TrainerSpec
    from rlhf_orch.trainer.training_engine import training_engine

    dist.init_process_group("gloo", rank=0, world_size=1)
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    model = load_policy(path, "float32")
    model.config.use_cache = False
    rss_model = rss_gb()
    spec = TrainerSpec(
        model_path=path, dtype="float32", zero_stage=stage, micro_batch_size=MICRO_BATCH,
        train_batch_size=MICRO_BATCH * ACCUMULATION, data_parallel_size=1, pad_id=0, temperature=1.0,
        lr=3e-5, weight_decay=0.0, grad_clip=1.0, clip_eps=0.2, ppo_epochs=1, seed=0, torch_threads=2,
        optimizer="adamw", reference_memory="full",
    )  # fmt: skip
    engine = training_engine(model, spec, WorkCount())  # (the policy actor's own: AdamW, its DeepSpeed config)
    rss_engine = rss_gb()
    ids = torch.randint(0, model.config.vocab_size, (steps * ACCUMULATION, MICRO_BATCH, SEQ_LEN),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    times = []
    for step in range(steps):
        t = time.perf_counter()
        for k in range(ACCUMULATION):
            batch = ids[step * ACCUMULATION + k]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t)
    torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, params_out)
    return {
        "stage": stage,
        "rss_model_gb": rss_model,
        "rss_engine_gb": rss_engine,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--_stage", nargs=3, metavar=("PATH", "STAGE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._stage:  # the child: one stage, one JSON line
        path, stage, out = args._stage
        print("RESULT " + json.dumps(one_stage(path, int(stage), args.steps, out)), flush=True)
        return
    import torch

    path = model_path(args.model)
    rows, params = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in STAGES:
            out = str(Path(tmp) / f"stage{stage}.pt")
            done = subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--_stage", path, str(stage), out],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "2"},
            )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise SystemExit(f"stage {stage} failed: {' | '.join(tail)}")
            rows.append(json.loads(line.removeprefix("RESULT ")))
            params[stage] = torch.load(out)
    a, b = params[STAGES[0]], params[STAGES[1]]
    max_diff = max((a[n] - b[n]).abs().max().item() for n in a)
    print(f"\n{args.model}, float32, one rank, AdamW; {args.steps} optimizer steps of {ACCUMULATION} x "
          f"{MICRO_BATCH} x {SEQ_LEN} tokens")  # fmt: skip
    print(f"{'ZeRO stage':<12}{'RSS model GB':>14}{'RSS engine GB':>15}{'peak RSS GB':>13}{'s/step':>9}")
    for r in rows:
        print(
            f"{r['stage']:<12}{r['rss_model_gb']:>14.2f}{r['rss_engine_gb']:>15.2f}"
            f"{r['peak_rss_gb']:>13.2f}{r['step_s']:>9.2f}"
        )
    print(f"largest parameter difference after the steps, stage {STAGES[0]} vs {STAGES[1]}: {max_diff:.3e}")
    by = {r["stage"]: r for r in rows}
    result = {"model": args.model, "steps": args.steps, "max_param_diff": max_diff}
    for stage, r in by.items():
        for key in ("rss_engine_gb", "peak_rss_gb", "step_s"):
            result[f"{key}_stage{stage}"] = round(r[key], 3)
    result["peak_rss_saved_gb"] = round(by[STAGES[0]]["peak_rss_gb"] - by[STAGES[1]]["peak_rss_gb"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
