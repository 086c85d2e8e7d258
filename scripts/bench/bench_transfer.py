"""Rollout transfer at seed scale: padded vs micro_batched vs packed, on real Ray actors, no model.

The scenario that broke OpenRLHF's single controller: a rollout of 256 prompts x 16 samples,
max_len 8192 (prompt <= 1024, response <= 7168), long-tailed response lengths (mean ~2000), every
per-token field of a PPO experience (engine/old/ref logprobs, values, advantages, returns, masks).
N engine actors produce it (`SyntheticEngine`: the strategies' real engine-side code without a
model), M trainer actors on Ray logical GPUs receive it (`TrainerSink`: the trainers' real
receiving code without a model). The object store is capped (default 8 GB).

For each strategy, in the same run:
  transfer_s   from "generation finished" on the engines (padded, packed) or from the first
               micro-batch (micro_batched, streaming) to "every trainer holds its data"
  exposed_s    from "generation finished" to "every trainer holds its data" (what a step waits for)
  wire_gb      bytes of the experience objects the trainers receive
  store_peak   peak object-store use (Ray's own stats, polled), spilled (Ray's own stats)
  driver_rss   driver peak RSS growth over the run of that strategy
and the limit: one memcpy of the packed bytes in one process. Then a size sweep (64x8 ... 512x16).
Prints a table and a final JSON line.

    .venv/bin/python scripts/bench/bench_transfer.py                       # the seed scenario + sweep
    .venv/bin/python scripts/bench/bench_transfer.py --sweep none --strategies packed,padded
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil
import ray
import torch

from rlhf_orch.transfer.base import RolloutRequest, RolloutTransfer, Route
from rlhf_orch.transfer.micro_batched import MicroBatchedTransfer
from rlhf_orch.transfer.packed import PackedTransfer
from rlhf_orch.transfer.padded import PaddedTransfer
from rlhf_orch.transfer.synthetic import LengthModel, SyntheticEngine, TrainerSink, synthetic_prompts, zero_reward

MiB = 2**20


# --------------------------------------------------------------------------- Ray's own stats
class StoreMonitor:
    """Polls Ray's aggregate object-store stats (plasma use, spilled) and the driver's RSS."""

    _PLASMA = re.compile(r"Plasma memory usage (\d+) MiB")
    _SPILLED = re.compile(r"Spilled (\d+) MiB")

    def __init__(self, interval_s: float = 0.05):
        from ray._private.internal_api import memory_summary

        self._summary = memory_summary
        self._address = ray.get_runtime_context().gcs_address
        self.interval_s = interval_s
        self._proc = psutil.Process()

    def stats(self) -> tuple[int, int]:
        text = self._summary(address=self._address, stats_only=True)
        plasma = self._PLASMA.search(text)
        spilled = self._SPILLED.search(text)
        return (int(plasma.group(1)) * MiB if plasma else 0, int(spilled.group(1)) * MiB if spilled else 0)

    def __enter__(self) -> "StoreMonitor":
        self.rss0 = self._proc.memory_info().rss
        self.rss_peak = self.rss0
        self.store_peak, self.spilled0 = self.stats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                plasma, _ = self.stats()
                self.store_peak = max(self.store_peak, plasma)
            except Exception:  # a missed sample is not a result
                pass
            self.rss_peak = max(self.rss_peak, self._proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rss_peak = max(self.rss_peak, self._proc.memory_info().rss)
        plasma, spilled = self.stats()
        self.store_peak = max(self.store_peak, plasma)
        self.spilled = spilled - self.spilled0


# --------------------------------------------------------------------------- one measurement
@dataclass
class Result:
    strategy: str
    prompts: int
    samples: int
    real_tokens: int
    wire_tokens: int
    wire_bytes: int
    transfer_s: float
    exposed_s: float
    store_peak_bytes: int
    spilled_bytes: int
    driver_rss_growth_mb: float
    breakdown: dict

    def row(self) -> str:
        return (
            f"{self.prompts:>4}x{self.samples:<3} {self.strategy:<14} {self.real_tokens / 1e6:7.2f}M {self.wire_tokens / 1e6:8.2f}M "
            f"{self.wire_bytes / 1e9:7.3f} {self.transfer_s:9.3f} {self.exposed_s:9.3f} {self.store_peak_bytes / 1e9:9.3f} "
            f"{self.spilled_bytes / 1e9:8.3f} {self.driver_rss_growth_mb:9.1f}"
        )


HEADER = (
    f"{'rollout':<8} {'strategy':<14} {'real':>8} {'wire_tok':>9} {'wire_GB':>7} {'transfer_s':>9} {'exposed_s':>9} "
    f"{'store_GB':>9} {'spill_GB':>8} {'drvRSS_MB':>9}"
)

STRATEGIES: dict[str, type[RolloutTransfer]] = {
    "padded": PaddedTransfer,
    "micro_batched": MicroBatchedTransfer,
    "packed": PackedTransfer,
}


def hand_over_profile(route: Route, sinks, timings: dict) -> dict:
    """Packed: where the hand-over's time goes, from the engines' and trainers' own stamps.

    engine_gather     slowest engine laying out its pieces from its flat buffers (one copy)
    store_and_fetch   last gather done -> last trainer has mapped its pieces: Ray writing the
                      pieces into the object store (one copy) and the trainers fetching them
    trainer_assemble  slowest trainer cutting its micro-batches (views; a copy only where a
                      micro-batch spans engines)
    driver_and_rpc    the rest of the hand-over: metadata to the driver, planning, the calls
    """
    cuts = [c for c in ray.get([e.last_cut_timing.remote() for e in route.engines]) if c]
    stages = [t for t in ray.get([s.last_stage_timing.remote() for s in sinks]) if t]
    if not cuts or not stages:
        return {}
    profile = {
        "engine_gather": max(c["gathered"] - c["start"] for c in cuts),
        "store_and_fetch": max(t["fetched"] for t in stages) - max(c["gathered"] for c in cuts),
        "trainer_assemble": max(t["assembled"] - t["fetched"] for t in stages),
    }
    profile["driver_and_rpc"] = timings["transfer"] - sum(profile.values())
    return profile


def measure(name: str, transfer: RolloutTransfer, request: RolloutRequest, route: Route, sinks) -> Result:
    ray.get([s.clear.remote() for s in sinks])
    gc.collect()
    with StoreMonitor() as mon:
        delivery = transfer.deliver(request, route)
    t = dict(delivery.timings)
    if isinstance(transfer, PackedTransfer):
        t.update(hand_over_profile(route, sinks, t))
    ray.get([s.clear.remote() for s in sinks])
    return Result(
        strategy=name,
        prompts=len(request.prompts),
        samples=request.samples_per_prompt,
        real_tokens=delivery.real_tokens,
        wire_tokens=delivery.wire_tokens,
        wire_bytes=delivery.wire_bytes,
        # padded/packed: from the engines' generation end (gather to the driver included for
        # padded); micro_batched: from the first micro-batch (see the strategies' deliver).
        transfer_s=t["transfer"],
        exposed_s=t["transfer_after_generate"],
        store_peak_bytes=mon.store_peak,
        spilled_bytes=mon.spilled,
        driver_rss_growth_mb=(mon.rss_peak - mon.rss0) / MiB,
        breakdown={k: round(v, 4) for k, v in t.items()},
    )


def memcpy_limit_s(nbytes: int, repeats: int = 3) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--response-max", type=int, default=7168)
    ap.add_argument("--mean-response", type=float, default=2000.0, help="mean response length (lognormal, clipped)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of response lengths (tail weight)")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--trainers", type=int, default=4, help="trainer actors, one Ray logical GPU each")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=0, help="packed; 0 = micro_batch_size x max_len")
    ap.add_argument("--max-in-flight", type=int, default=8)
    ap.add_argument("--object-store-gb", type=float, default=8.0)
    ap.add_argument("--strategies", default="padded,micro_batched,packed")
    ap.add_argument("--sweep", default="64x8,128x16,256x16,512x16", help="'none' or PROMPTSxSAMPLES,...")
    ap.add_argument("--sweep-strategies", default="packed,micro_batched,padded")
    ap.add_argument(
        "--padded-max-seqs",
        type=int,
        default=4096,
        help="sweep: skip padded above this many sequences (512x16 padded needs ~3.3 GB on the driver "
        "plus as much in the store, and minutes, on a 23 GB box)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default="", help="also write the final JSON to this file")
    args = ap.parse_args(argv)

    max_len = args.prompt_max + args.response_max
    ray.init(
        num_cpus=max(2, psutil.cpu_count() or 2),
        num_gpus=args.trainers,
        object_store_memory=int(args.object_store_gb * 2**30),
        include_dashboard=False,
        log_to_driver=False,
    )
    lengths = LengthModel(mean=args.mean_response, max_len=args.response_max, sigma=args.sigma)
    # Engines and sinks take no CPU reservation: the point is the data path, not scheduling.
    engines = [ray.remote(num_cpus=0)(SyntheticEngine).remote(lengths, seed=args.seed) for _ in range(args.engines)]
    sinks = [ray.remote(num_cpus=0, num_gpus=1)(TrainerSink).remote(pad_id=0) for _ in range(args.trainers)]
    ray.get([a.ping.remote() for a in (*engines, *sinks)])
    route = Route(
        engines=engines, consumers=[[s] for s in sinks], get=lambda refs, what="", engine_call=False: ray.get(refs)
    )

    def request(prompts: int, samples: int) -> RolloutRequest:
        return RolloutRequest(
            prompts=[None] * prompts,
            prompt_ids=synthetic_prompts(prompts, args.prompt_max, seed=args.seed),
            samples_per_prompt=samples,
            max_tokens=args.response_max,
            temperature=1.0,
            scorer=zero_reward,
            num_shards=args.trainers,
            micro_batch_size=args.micro_batch_size,
            pad_id=0,
            max_seq_len=max_len,
            decode=lambda ids: [""] * len(ids),
        )

    def build(name: str) -> RolloutTransfer:
        # Each strategy takes its own knob (the others would do nothing for it).
        knobs = {"micro_batched": {"max_in_flight": args.max_in_flight}, "packed": {"token_budget": args.token_budget}}
        return STRATEGIES[name](**knobs.get(name, {}))

    print(
        f"seed scenario {args.prompts}x{args.samples}, max_len {max_len}, {args.engines} engines -> "
        f"{args.trainers} trainers, object store {args.object_store_gb:g} GB",
        flush=True,
    )
    print(HEADER, flush=True)
    seed_results: dict[str, Result] = {}
    for name in args.strategies.split(","):
        r = measure(name, build(name), request(args.prompts, args.samples), route, sinks)
        seed_results[name] = r
        print(r.row(), flush=True)
        if "engine_gather" in r.breakdown:
            parts = (
                "metadata_to_driver",
                "plan",
                "engine_gather",
                "store_and_fetch",
                "trainer_assemble",
                "driver_and_rpc",
            )
            print(
                "         hand-over: " + ", ".join(f"{k} {r.breakdown[k]:.3f}" for k in parts if k in r.breakdown),
                flush=True,
            )

    packed = seed_results.get("packed")
    memcpy_s = memcpy_limit_s(packed.wire_bytes) if packed else float("nan")
    if packed:
        print(
            f"memcpy limit: {packed.wire_bytes / 1e9:.3f} GB in {memcpy_s:.3f} s ({packed.wire_bytes / memcpy_s / 1e9:.1f} GB/s)",
            flush=True,
        )

    sweep: list[Result] = []
    if args.sweep != "none":
        print("\nsize sweep", flush=True)
        print(HEADER, flush=True)
        for size in args.sweep.split(","):
            prompts, samples = map(int, size.lower().split("x"))
            for name in args.sweep_strategies.split(","):
                if name == "padded" and prompts * samples > args.padded_max_seqs:
                    print(
                        f"{prompts:>4}x{samples:<3} padded         skipped (--padded-max-seqs {args.padded_max_seqs})",
                        flush=True,
                    )
                    continue
                same = seed_results.get(name) if (prompts, samples) == (args.prompts, args.samples) else None
                r = same or measure(name, build(name), request(prompts, samples), route, sinks)
                sweep.append(r)
                print(r.row(), flush=True)

    summary: dict = {
        "scenario": {
            "prompts": args.prompts,
            "samples": args.samples,
            "max_len": max_len,
            "prompt_max": args.prompt_max,
            "response_max": args.response_max,
            "mean_response_target": args.mean_response,
            "sigma": args.sigma,
            "engines": args.engines,
            "trainers": args.trainers,
            "object_store_gb": args.object_store_gb,
            "micro_batch_size": args.micro_batch_size,
            "token_budget": args.token_budget or args.micro_batch_size * max_len,
            "max_in_flight": args.max_in_flight,
        },
        "results": {k: vars(v) for k, v in seed_results.items()},
        "memcpy_limit_s": memcpy_s,
        "sweep": [vars(r) for r in sweep],
    }
    if packed:
        summary["mean_seq_len"] = packed.real_tokens / (args.prompts * args.samples)  # prompt + response
        summary["spilled_bytes_packed"] = packed.spilled_bytes
        summary["driver_rss_growth_mb_packed"] = packed.driver_rss_growth_mb
        summary["packed_over_memcpy"] = packed.transfer_s / memcpy_s
        if "padded" in seed_results:
            summary["speedup_packed_vs_padded"] = seed_results["padded"].transfer_s / packed.transfer_s
        per_mtok = [r.transfer_s / (r.real_tokens / 1e6) for r in sweep if r.strategy == "packed"]
        if len(per_mtok) > 1:
            summary["packed_s_per_mtoken_sweep"] = per_mtok
            summary["packed_linearity_max_over_min"] = max(per_mtok) / min(per_mtok)
        summary["goals"] = {
            "speedup_ge_50x": summary.get("speedup_packed_vs_padded", 0) >= 50,
            "within_5x_memcpy": summary["packed_over_memcpy"] <= 5,
            "zero_spill": packed.spilled_bytes == 0,
            "driver_growth_lt_100mb": packed.driver_rss_growth_mb < 100,
        }
    ray.shutdown()
    line = json.dumps(summary)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)
    return summary


if __name__ == "__main__":
    main()
