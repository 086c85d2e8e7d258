"""Multi-sender bucketed broadcast: several policy (data-parallel) ranks send at once.

With one sender, that rank's link carries every byte to every engine and becomes the ceiling.
Here each of `senders` policy ranks is rank 0 of its own broadcast group and sends a share:
- `shard_by: buckets` — every engine is in every group; sender s broadcasts the buckets it owns
  (balanced by bytes, interleaved so all senders work from the first bucket on). Each sender's
  link carries 1/S of the model.
- `shard_by: engines` — engine e is only in group e mod S; each sender broadcasts every bucket to
  its engines. Each sender's link carries the model once, to 1/S of the engines.
Packing, bucketing, buffers and the engine's streaming reload are those of the single-sender
strategy; only the groups and the per-bucket routing differ: its engine side is
`bucketed.ReceiveBuckets`, handed one route per bucket. Under ZeRO-2 every rank already
holds all weights; under ZeRO-3 every rank joins every bucket's gather and only the owner sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_orch.sync.base import GroupSpec
from rlhf_orch.sync.bucketed import BucketedBroadcastSync
from rlhf_orch.sync.buckets import Bucket, balanced_owners
from rlhf_orch.sync.group import DEFAULT_GROUP


@dataclass(frozen=True)
class _BucketShares:
    """Each sender owns a share of the buckets and sends it to every engine."""

    def engines_of(self, sender: int, senders: int, engines: int) -> tuple[int, ...]:
        return tuple(range(engines))

    def route(self, buckets: list[Bucket], engines: int, senders: int) -> list[list[int]]:
        owners = balanced_owners(buckets, senders)
        return [list(owners) for _ in range(engines)]

    def receive_ahead(self, senders: int) -> int:
        # One bucket posted per sender keeps every sender's broadcast able to proceed.
        return senders

    def max_senders(self, engines: int) -> int:
        return 1 << 30


@dataclass(frozen=True)
class _EngineShares:
    """Each sender owns a share of the engines and sends them every bucket."""

    def engines_of(self, sender: int, senders: int, engines: int) -> tuple[int, ...]:
        return tuple(e for e in range(engines) if e % senders == sender)

    def route(self, buckets: list[Bucket], engines: int, senders: int) -> list[list[int]]:
        return [[e % senders] * len(buckets) for e in range(engines)]

    def receive_ahead(self, senders: int) -> int:
        return 1

    def max_senders(self, engines: int) -> int:
        return engines  # a sender without engines would idle


SHARDINGS = {"buckets": _BucketShares(), "engines": _EngineShares()}


class MultiSenderBroadcastSync(BucketedBroadcastSync):
    def __init__(self, *, backend: str, timeout_s: float, bucket_mb: float, senders: int, shard_by: str):
        super().__init__(backend=backend, timeout_s=timeout_s, bucket_mb=bucket_mb)
        if shard_by not in SHARDINGS:
            raise ValueError(f"sync.shard_by={shard_by!r}: use one of {sorted(SHARDINGS)}")
        if senders < 1:
            raise ValueError(f"sync.senders={senders}: must be >= 1")
        self.senders = senders
        self.shard_by = shard_by
        self._sharding = SHARDINGS[shard_by]

    def active_senders(self, policy_ranks: int, engines: int) -> int:
        """Senders actually used: never more than there are policy ranks (nor engines, when sharding them).

        With one policy rank this is the single-sender bucketed broadcast over a named group.
        """
        return max(1, min(self.senders, policy_ranks, self._sharding.max_senders(engines)))

    def group_specs(self, policy_ranks: int, engines: int) -> list[GroupSpec]:
        n = self.active_senders(policy_ranks, engines)
        return [GroupSpec(f"{DEFAULT_GROUP}/sender{s}", s, self._sharding.engines_of(s, n, engines)) for s in range(n)]

    def route(self, buckets: list[Bucket], engines: int) -> list[list[int]]:
        return self._sharding.route(buckets, engines, len(self._specs))

    def receive_ahead(self) -> int:
        return self._sharding.receive_ahead(len(self._specs))
