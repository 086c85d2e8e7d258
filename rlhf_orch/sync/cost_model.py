"""A cost model of one weight update: per-call latency plus per-byte pack, wire and load costs.

Fitted by `scripts/bench/bench_sync.py` to real engines on this machine, then used to project the sync
time of a published model on published hardware (the bench's projection and
`scripts/reproduce.py`'s "projected" figures). Every projection states its assumptions: see
docs/benchmarks.md, "Weight sync".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Llama-3-8B for the projections: 16.06 GB in bf16, 291 tensors (untied lm_head).
LLAMA3_8B = {"bytes": 16_060_522_496, "tensors": 291}
LINKS_GBPS = {"nvlink_class": 150.0, "infiniband_class": 25.0}
# GPU-side per-byte costs for the projection: packing and the engine's load are device-memory copies.
GPU_COPY_GBPS = 1000.0


@dataclass
class CostModel:
    """Per-update sync time from a few per-call and per-byte costs, fitted to this run.

    per_call_s: latency of one engine round trip for one tensor in the per-tensor path, excluding
    its bytes (Ray RPC + collective launch + vLLM's per-call overhead), by engine count.
    pack_gbps / load_gbps: sender packing and engine load (vLLM's reload incl. CPU repacking).
    wire: the limit's time t(E) = bytes * (a + b * (E - 1)); gloo's root sends one copy per engine.
    """

    per_call_s: dict[int, float]
    pack_gbps: float
    load_gbps: float
    wire_a_s_per_gb: float
    wire_b_s_per_gb: float
    memcpy_gbps: float

    def wire_s(self, nbytes: int, engines: int) -> float:
        return nbytes / 1e9 * (self.wire_a_s_per_gb + self.wire_b_s_per_gb * (engines - 1))

    def per_call(self, engines: int) -> float:
        known = sorted(self.per_call_s)
        if engines in self.per_call_s:
            return self.per_call_s[engines]
        # Beyond the measured counts: linear in the engine count (one RPC per engine per tensor).
        hi, lo = known[-1], known[0]
        slope = (self.per_call_s[hi] - self.per_call_s[lo]) / max(hi - lo, 1)
        return self.per_call_s[hi] + slope * (engines - hi)

    def fanout_growth(self) -> float:
        """Extra wire time per extra engine, relative to one engine (gloo: the root sends each copy)."""
        return self.wire_b_s_per_gb / max(self.wire_a_s_per_gb, 1e-12)

    def project(
        self, nbytes: int, tensors: int, engines: int, link_gbps: float, bucket_mb: float, senders: int
    ) -> dict:
        """Seconds per update on GPUs whose links run at `link_gbps` (assumptions: docs/benchmarks.md).

        - per-call latency: as measured here (host-side Ray RPC + collective launch + vLLM per call),
          extrapolated linearly in the engine count; it does not get faster on a GPU.
        - pack and load: memory-bound copies; this run's per-byte costs scaled by GPU_COPY_GBPS /
          this machine's memcpy bandwidth (so their efficiency relative to a plain copy is kept).
        - wire, two bounds: `pipelined` (NCCL ring/tree broadcast: every link carries the bytes
          once, any engine count) and `fanout` (the root sends one copy per engine, with the
          growth measured here for gloo).
        - the strategies overlap pack, wire and load (bucketed, multi-sender) or do not (per-tensor).
        """
        gb = nbytes / 1e9
        scale = GPU_COPY_GBPS / self.memcpy_gbps
        pack = gb / (self.pack_gbps * scale)
        load = gb / (self.load_gbps * scale)
        call = self.per_call(engines)
        buckets = max(1, math.ceil(nbytes / (bucket_mb * 2**20)))
        bucket_gb = gb / buckets
        out = {}
        for wire_kind, growth in (("pipelined", 0.0), ("fanout", self.fanout_growth())):
            wire_one = gb / link_gbps  # one copy over one link
            wire = wire_one * (1 + growth * (engines - 1))
            # Pipeline fill and drain: the first bucket's pack, the last bucket's wire and load.
            edge = bucket_gb * ((pack + load) / gb) + bucket_gb / link_gbps
            by_buckets = max(wire / senders, wire_one)  # each engine still receives every byte
            by_engines = wire_one * (1 + growth * (math.ceil(engines / senders) - 1))
            per_tensor = tensors * call + wire + load
            bucketed = call + max(pack, wire, load) + edge
            out[wire_kind] = {
                "per_tensor_s": round(per_tensor, 3),
                "bucketed_s": round(bucketed, 3),
                "multi_sender_buckets_s": round(call + max(pack / senders, by_buckets, load) + edge, 3),
                "multi_sender_engines_s": round(call + max(pack, by_engines, load) + edge, 3),
                "wire_floor_s": round(wire_one, 3),
                "speedup_bucketed_vs_per_tensor": round(per_tensor / bucketed, 2),
            }
        return out


# The fit recorded in docs/benchmarks.md ("Weight sync", quiet machine, 2026-11-21,
# `python scripts/bench/bench_sync.py`): what projections use when no fresh fit is at hand.
RECORDED_FIT = CostModel(
    per_call_s={1: 0.0029, 2: 0.0049, 4: 0.0075},
    pack_gbps=3.7,
    load_gbps=0.72,
    wire_a_s_per_gb=0.465,
    wire_b_s_per_gb=0.398,
    memcpy_gbps=10.6,
)
