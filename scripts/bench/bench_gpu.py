"""What a GPU measures that this project's CPU runs cannot: the memory plan's GPU terms and the
`cuda_ipc` hand-over at a real model's size. Needs PyTorch with CUDA, transformers and DeepSpeed only
(no Ray, no vLLM), so it runs on a bare GPU machine.

Parts (each case in a fresh process, so every peak belongs to one process):
  memory  one policy update under DeepSpeed ZeRO-0..3 (world size 1, the project's DeepSpeed config,
          AdamW, bf16) of a model of a committed experiment's shape with random weights, on a packed
          micro-batch through the trainer's own forward (`sequence_logprobs`, packed attention). Measured
          with torch's allocator: the resident states after the first step against the plan's `always`
          terms (`rlhf_orch.memory.terms.trainer_terms`), the second step's peak above them against its
          `train` terms, the allocator's reserve above the peak (fragmentation), and the process's own
          GPU memory (nvidia-smi's per-process figure less torch's reserve: CUDA context, cuBLAS, NCCL)
          against the plan's `runtime` term.
  ipc     the `cuda_ipc` sync of a 7B model's state dict (bf16) between two processes on one GPU: the
          trainer packs 512 MB buckets (`rlhf_orch.sync.buckets`), hands over their IPC handles
          (`rlhf_orch.sync.cuda_ipc_handles`); the engine copies each bucket out and loads it into its
          own weights, as `rlhf_orch.sync.handover.LoadBucket` does. Limit measured in the same run:
          one device-to-device copy of the same bytes. Every tensor's checksum is compared after the sync.

Usage: python scripts/bench/bench_gpu.py [--parts memory,ipc] [--quick]   (prints tables and one JSON line)
       python scripts/bench_memory.py --gpu                        (the memory part alone)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rlhf_orch.memory.shapes import KNOWN_CONFIGS, ModelShape
from rlhf_orch.memory.terms import ALWAYS, TRAIN, Workload, trainer_terms

GB = 1e9
RUNTIME = "runtime"


@dataclass(frozen=True)
class MemoryCase:
    model: str  # a KNOWN_CONFIGS key
    zero_stage: int
    sequences: int
    seq_len: int
    gradient_checkpointing: bool = False

    @property
    def label(self) -> str:
        short = self.model.split("/")[-1]
        return (
            f"{short} z{self.zero_stage}{' gc' if self.gradient_checkpointing else ''} {self.sequences}x{self.seq_len}"
        )

    def workload(self) -> Workload:
        return Workload(
            dtype="bfloat16",
            max_seq_len=self.seq_len,
            micro_batch_size=self.sequences,
            tokens_per_micro_batch=self.sequences * self.seq_len,
            padded=False,
            zero_stage=self.zero_stage,
            optimizer="adamw",
            offload_optimizer=False,
            gradient_checkpointing=self.gradient_checkpointing,
            on_gpu=True,
        )

    def planned(self) -> dict[str, int]:
        shape = ModelShape.from_config(KNOWN_CONFIGS[self.model])
        # (the stage this bench gives DeepSpeed itself: a run would take one rank's ZeRO-1/2 as stage 0)
        terms = trainer_terms("actor", shape.policy_params, shape, self.workload(), dp=1, stage=self.zero_stage)
        return {
            "always": sum(t.bytes for t in terms if t.phase == ALWAYS and t.name != RUNTIME and not t.on_host),
            "train": sum(t.bytes for t in terms if t.phase == TRAIN),
            "runtime": sum(t.bytes for t in terms if t.name == RUNTIME),
            "terms": {t.name: t.bytes for t in terms},
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_used_by(pid: int) -> int | None:
    """nvidia-smi's GPU memory of one process (bytes), None where it cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * 2**20
    return None


def _hf_config(model: str):
    """transformers' config of a KNOWN_CONFIGS model (its dtype field aside: the bench picks bf16)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in KNOWN_CONFIGS[model].items() if k != "torch_dtype"}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# --------------------------------------------------------------------------- memory
def _memory_case(case: MemoryCase, port: int, results, release) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    import deepspeed
    from transformers import AutoModelForCausalLM

    from rlhf_orch.trainer.deepspeed_config import deepspeed_config
    from rlhf_orch.trainer.deepspeed_startup import skip_muon_import
    from rlhf_orch.trainer.forward import enable_gradient_checkpointing, packed_attention_impl, sequence_logprobs
    from rlhf_orch.transfer.batch import PackedBatch, Sample

    skip_muon_import()
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    config = _hf_config(case.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=packed_attention_impl("cuda")).to(
            torch.bfloat16
        )
    model.config.use_cache = False
    if case.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95))
    ds_config = deepspeed_config(
        zero_stage=case.zero_stage,
        micro_batch_size=1,
        train_batch_size=1,
        data_parallel_size=1,
        grad_clip=1.0,
        dtype="bfloat16",
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    g = torch.Generator().manual_seed(0)
    prompt = case.seq_len // 4
    samples = [
        Sample(
            prompt_ids=torch.randint(0, config.vocab_size, (prompt,), generator=g),
            response_ids=torch.randint(0, config.vocab_size, (case.seq_len - prompt,), generator=g),
            reward=1.0,
            index=i,
        )
        for i in range(case.sequences)
    ]
    batch = PackedBatch.from_samples(samples).to("cuda")
    mask = batch.action_mask.float()

    def step() -> float:
        t0 = time.perf_counter()
        logprobs = sequence_logprobs(engine, batch, 1.0)
        loss = -(logprobs * mask).sum() / mask.sum()  # a policy-gradient loss of the same graph
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()  # the optimizer's states exist after the first step
    states = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = step()
    out = {
        "states": states,
        "peak": torch.cuda.max_memory_allocated(),
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "reserved_now": torch.cuda.memory_reserved(),
        "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        "step_s": seconds,
        "pid": os.getpid(),
    }
    # What a trainer sharing its GPU does as each phase ends (rlhf_orch/trainer/phase_memory.py): the
    # call, what stays reserved after it, and the next update allocating again what it gave back.
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    out.update(
        empty_cache_s=time.perf_counter() - t0,
        reserved_after_empty=torch.cuda.memory_reserved(),
        step_after_empty_s=step(),
    )
    out["reserved_now"] = torch.cuda.memory_reserved()  # (what nvidia-smi is read against)
    results.put(out)
    release.wait(120)  # the parent reads nvidia-smi for this process meanwhile


def _result_of(proc, results, limit_s: float):
    """The child's result, or None once it died or `limit_s` passed (then it is killed)."""
    import queue

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            if not proc.is_alive():
                return None
    proc.kill()
    proc.join(10)
    return None


def run_memory(cases: list[MemoryCase]) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for case in cases:
        results, release = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_memory_case, args=(case, _free_port(), results, release), daemon=True)
        proc.start()
        got = _result_of(proc, results, 600)
        if got is None:
            rows.append({"case": case.label, "error": f"no result (exit code {proc.exitcode})"})
            continue
        smi = _gpu_used_by(got["pid"])
        release.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        plan = case.planned()
        row = {
            "case": case.label,
            "params": got["params"],
            "step_s": round(got["step_s"], 3),
            "states_gb": got["states"] / GB,
            "plan_always_gb": plan["always"] / GB,
            "train_gb": (got["peak"] - got["states"]) / GB,
            "plan_train_gb": plan["train"] / GB,
            "peak_gb": got["peak"] / GB,
            "plan_peak_gb": (plan["always"] + plan["train"]) / GB,
            "reserved_over_peak_gb": (got["reserved_peak"] - got["peak"]) / GB,
            "runtime_gb": None if smi is None else (smi - got["reserved_now"]) / GB,
            "plan_runtime_gb": plan["runtime"] / GB,
            "plan_terms_gb": {k: round(v / GB, 3) for k, v in plan["terms"].items()},
            "empty_cache_s": round(got["empty_cache_s"], 4),
            "reserved_after_empty_gb": got["reserved_after_empty"] / GB,
            "step_after_empty_s": round(got["step_after_empty_s"], 3),
        }
        row["peak_error"] = row["plan_peak_gb"] / row["peak_gb"] - 1
        if row["runtime_gb"] is not None:  # the process's own GPU memory at its peak, as nvidia-smi counts it
            row["process_gb"] = (got["reserved_peak"] + smi - got["reserved_now"]) / GB
            row["plan_process_gb"] = row["plan_peak_gb"] + row["plan_runtime_gb"]
            row["process_error"] = row["plan_process_gb"] / row["process_gb"] - 1
        rows.append(row)
        print(
            f"  {case.label}: measured peak {row['peak_gb']:.2f} GB, planned {row['plan_peak_gb']:.2f} GB; empty_cache "
            f"{row['empty_cache_s']:.4f} s, {row['reserved_after_empty_gb']:.2f} GB reserved after it (states "
            f"{row['states_gb']:.2f}), the next step {row['step_after_empty_s']:.2f} s (against {row['step_s']:.2f})",
            flush=True,
        )
    return rows


# --------------------------------------------------------------------------- ipc
def _state_dict_shapes(model: str) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    config = _hf_config(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in meta.state_dict().items()}


def _checksums(tensors: dict) -> dict[str, float]:
    return {n: float(t.float().sum().item()) for n, t in tensors.items()}


def _engine_side(shapes: dict, inbox, outbox) -> None:
    import torch

    from rlhf_orch.sync.buckets import unpack_bucket

    torch.cuda.set_device(0)
    weights = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}
    pool: list = [None, None]  # the two receive buffers, grown to the largest bucket
    outbox.put("ready")
    while True:
        item = inbox.get()
        if item == "stop":
            return
        if item == "checksums":
            outbox.put(_checksums(weights))
            continue
        if item == "zero":  # before a checked sync: nothing an earlier round loaded can pass for it
            for t in weights.values():
                t.zero_()
            torch.cuda.synchronize()
            outbox.put("zeroed")
            continue
        bucket, payload = item
        slot = bucket.index % 2
        if pool[slot] is None or pool[slot].numel() < bucket.nbytes:
            pool[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
        view = pool[slot][: bucket.nbytes]
        payload.copy_into(view)  # the sender may reuse its buffer from here on
        for name, tensor in unpack_bucket(bucket, view):
            weights[name].copy_(tensor)
        torch.cuda.current_stream().synchronize()
        outbox.put(bucket.index)


def run_ipc(model: str, bucket_mbs: list[int], reps: int) -> dict:
    import torch

    from rlhf_orch.sync.buckets import TensorMeta, bucket_capacity, pack_bucket, plan_buckets
    from rlhf_orch.sync.cuda_ipc_handles import cuda_ipc_payload

    shapes = _state_dict_shapes(model)
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for n, s in shapes.items():
        weights[n] = torch.empty(s, dtype=torch.bfloat16, device="cuda")
        weights[n].normal_(generator=g)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    # The limit: one device-to-device copy of the same bytes (a 2 GB block, scaled).
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_gbps = 5 * src.numel() / (time.perf_counter() - t0) / GB
    del src, dst
    torch.cuda.empty_cache()

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine_side, args=(shapes, inbox, outbox), daemon=True)
    engine.start()
    try:
        assert outbox.get(timeout=300) == "ready"
        expected = _checksums(weights)
        rows = []
        for mb in bucket_mbs:
            buckets = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], mb * 2**20)
            buffers = [torch.empty(bucket_capacity(buckets), dtype=torch.uint8, device="cuda") for _ in range(2)]

            def sync_once(buckets=buckets, buffers=buffers) -> float:
                t0 = time.perf_counter()
                pending = []
                for b in buckets:
                    if len(pending) == 2:  # both buffers in use: wait for the older bucket's load
                        assert outbox.get(timeout=300) == pending.pop(0)
                    inbox.put((b, cuda_ipc_payload(pack_bucket(b, weights, buffers[b.index % 2]))))
                    pending.append(b.index)
                for index in pending:
                    assert outbox.get(timeout=300) == index
                return time.perf_counter() - t0

            sync_once()  # warm-up (the engine's pool grows)
            seconds = min(sync_once() for _ in range(reps))
            inbox.put("zero")  # then one checked sync of this bucket size into zeroed weights
            assert outbox.get(timeout=300) == "zeroed"
            sync_once()
            inbox.put("checksums")
            received = outbox.get(timeout=300)
            mismatched = [n for n, v in expected.items() if received.get(n) != v]
            rows.append(
                {
                    "bucket_mb": mb,
                    "buckets": len(buckets),
                    "sync_s": seconds,
                    "gbps": nbytes / seconds / GB,
                    "mismatched": mismatched,
                }
            )
            print(
                f"  {mb} MB buckets: {len(buckets)} buckets, {seconds:.3f} s ({nbytes / seconds / GB:.0f} GB/s), "
                f"{len(mismatched)} tensors differ",
                flush=True,
            )
        inbox.put("stop")
        engine.join(60)
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join(10)
    # The path copies every byte three times (pack, the engine's copy out of the handle, the load).
    return {
        "model": model,
        "bytes": nbytes,
        "tensors": len(weights),
        "copy_gbps": copy_gbps,
        "copy_floor_s": nbytes / (copy_gbps * GB),
        "three_copies_s": 3 * nbytes / (copy_gbps * GB),
        "rows": rows,
    }


# --------------------------------------------------------------------------- report
def memory_cases(quick: bool) -> list[MemoryCase]:
    small = "Qwen/Qwen2.5-0.5B-Instruct"
    if quick:
        return [MemoryCase(small, 2, 2, 512)]
    return [MemoryCase(small, z, 4, 1024) for z in (0, 1, 2, 3)] + [
        MemoryCase(small, 2, 4, 1024, gradient_checkpointing=True),
        MemoryCase("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 2, 4, 1024),
        MemoryCase("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 3, 4, 1024, gradient_checkpointing=True),
    ]


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_memory(rows: list[dict]) -> None:
    print("\nMemory plan vs one DeepSpeed policy update on this GPU (GB = 1e9 bytes; allocated by torch)")
    print(
        f"{'case':<42} {'states':>7} {'plan':>7} {'train':>7} {'plan':>7} {'peak':>7} {'plan':>7} {'err':>6} "
        f"{'reserve+':>8} {'runtime':>7} {'plan':>5} {'s/step':>6}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<42} FAILED: {r['error']}")
            continue
        print(
            f"{r['case']:<42} {_f(r['states_gb']):>7} {_f(r['plan_always_gb']):>7} {_f(r['train_gb']):>7} "
            f"{_f(r['plan_train_gb']):>7} {_f(r['peak_gb']):>7} {_f(r['plan_peak_gb']):>7} {r['peak_error']:>+6.1%} "
            f"{_f(r['reserved_over_peak_gb']):>8} {_f(r['runtime_gb']):>7} {_f(r['plan_runtime_gb'], 1):>5} {r['step_s']:>6.2f}"
        )
    # scripts/bench_memory.py's table: the plan's process total against what the process held on the GPU
    print(f"\n{'configuration':42s} {'process':11s} {'predicted GB':>12s} {'measured GB':>12s} {'error':>8s}")
    for r in rows:
        if "process_gb" in r:
            print(
                f"{r['case']:42s} {'actor':11s} {r['plan_process_gb']:12.2f} {r['process_gb']:12.2f} {r['process_error']:+8.1%}"
            )


def print_ipc(result: dict) -> None:
    print(
        f"\ncuda_ipc sync of {result['model']} ({result['bytes'] / GB:.2f} GB, {result['tensors']} tensors, bf16) "
        f"between two processes on one GPU; limit: one device copy at {result['copy_gbps']:.0f} GB/s = "
        f"{result['copy_floor_s']:.3f} s"
    )
    print(f"(the path copies each byte three times: {result['three_copies_s']:.3f} s at that rate)")
    print(
        f"{'bucket MB':>9} {'buckets':>7} {'sync s':>7} {'GB/s':>6} {'x 1 copy':>8} {'x 3 copies':>10} {'checked':>9}"
    )
    for r in result["rows"]:
        checked = "equal" if not r["mismatched"] else f"{len(r['mismatched'])} differ"
        print(
            f"{r['bucket_mb']:>9} {r['buckets']:>7} {r['sync_s']:>7.3f} {r['gbps']:>6.0f} {r['sync_s'] / result['copy_floor_s']:>8.2f} "
            f"{r['sync_s'] / result['three_copies_s']:>10.2f} {checked:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="memory,ipc")
    parser.add_argument("--quick", action="store_true", help="one small case per part (a check that it runs)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    report = {
        "bench": "gpu",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / GB,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    try:
        import deepspeed
        import transformers

        report.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    except ImportError as e:
        report["import_error"] = str(e)
    print(json.dumps(report), flush=True)
    if "ipc" in parts:  # first: the shortest part
        try:
            report.update(ipc_part(args.quick))
        except Exception as e:  # a part that fails is reported; the next one still runs
            traceback.print_exc()
            report["ipc_error"] = f"{type(e).__name__}: {e}"
    if "memory" in parts:
        rows = run_memory(memory_cases(args.quick))
        print_memory(rows)
        report["memory"] = rows
        ok = [r for r in rows if "error" not in r]
        if ok:
            report["memory_max_abs_peak_error"] = max(abs(r["peak_error"]) for r in ok)
        if any("process_error" in r for r in ok):
            report["memory_max_abs_process_error"] = max(abs(r["process_error"]) for r in ok if "process_error" in r)
    print(json.dumps(report, default=str))
    return 0


def ipc_part(quick: bool) -> dict:
    model = "Qwen/Qwen2.5-0.5B-Instruct" if quick else "Qwen/Qwen2-7B-Instruct"
    result = run_ipc(model, [512] if quick else [128, 512, 2048], reps=1 if quick else 3)
    print_ipc(result)
    default = next(r for r in result["rows"] if r["bucket_mb"] == 512)
    return {
        "ipc": result,
        "ipc_sync_s_512mb": default["sync_s"],
        "ipc_x_copy_limit_512mb": default["sync_s"] / result["copy_floor_s"],
        "ipc_x_three_copies_512mb": default["sync_s"] / result["three_copies_s"],
        "ipc_checked_equal": all(not r["mismatched"] for r in result["rows"]),
    }


if __name__ == "__main__":
    sys.exit(main())
