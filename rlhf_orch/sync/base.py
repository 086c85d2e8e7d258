"""The interface every weight-sync strategy shares: prepare once, push every step, verify.

A strategy object is built on the driver by `hydra.utils.instantiate(cfg.sync)`. `prepare` and
`push` run on the driver and only issue Ray calls; `send` runs inside each policy rank (the
object is pickled there), next to the weights. Each strategy's module also holds its engine
side: the steps each engine is handed (`engine.receive_weights.remote(step)`) and runs in its vLLM
workers (`rlhf_orch.sync.receive`).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from rlhf_orch.one_line import named, one_line
from rlhf_orch.sync.group import DEFAULT_GROUP, BroadcastGroup


class WeightSyncError(RuntimeError):
    """A sync could not complete (dead engine, timeout): raised instead of hanging."""


@dataclass
class SyncReport:
    version: int
    seconds: float
    bytes_per_engine: int
    engines: int
    sender_stats: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_engine / max(self.seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class GroupSpec:
    """One broadcast group: a sending policy rank (group rank 0) and the engines it reaches.

    Each engine's workers follow the sender (`engine_tp` group ranks per engine, in order).
    """

    name: str
    sender: int
    engines: tuple[int, ...]


class WeightSync(abc.ABC):
    """Weights from the policy rank(s) to every engine worker.

    Subclasses say which groups they need (`group_specs`) and what one policy rank does during an
    update (`send`); forming the groups, fanning `send` out to every policy rank, timeouts and
    error translation are shared here.
    """

    # True: the policy ranks hand engines handles of their own CUDA memory (CUDA IPC). Such a sender
    # keeps torch's default allocator: with expandable segments a handle is a file descriptor the
    # receiver must fetch with pidfd_getfd, which unprivileged containers refuse.
    shares_cuda_memory: bool = False

    def __init__(self, *, backend: str, timeout_s: float):
        # No defaults: the values come from the sync option's declaration (hydra builds the strategy).
        self.backend = backend
        self.timeout_s = timeout_s
        self._policy: list[Any] = []
        self._engines: list[Any] = []
        self._specs: list[GroupSpec] = []
        self._engine_tp = 1

    # ------------------------------------------------------------------ driver side
    def use_plan(self, plan) -> None:
        """Told the run's `PlacementPlan` before `prepare` (CUDA IPC maps engine workers to the
        policy rank on their GPU); strategies that do not care ignore it."""

    def group_specs(self, policy_ranks: int, engines: int) -> list[GroupSpec]:
        """Groups to form once; default: policy rank 0 broadcasts to every engine."""
        return [GroupSpec(DEFAULT_GROUP, 0, tuple(range(engines)))]

    # ------------------------------------------------------------------ what the memory plan asks
    def send_buffers(self, policy_ranks: int, engines: int, on_gpu: bool) -> dict[int, int]:
        """Bytes each sending policy rank holds for buckets in flight (`rlhf_orch.memory`): on a GPU
        layout those on its GPU, on a CPU layout those in host memory (only while it sends there:
        `buckets.send_buffers`); none for a strategy that sends the parameters themselves."""
        return {}

    def nccl_senders(self, policy_ranks: int, engines: int) -> set[int]:
        """The policy ranks that join an NCCL communicator with the engines (every engine worker joins it too)."""
        return {spec.sender for spec in self.group_specs(policy_ranks, engines)} if self.backend == "nccl" else set()

    def prepare(self, policy_ranks: list[Any], engines: list[Any], engine_tp: int) -> None:
        """Form every group once; each sender hosts its group's rendezvous store."""
        self._policy, self._engines = list(policy_ranks), list(engines)
        self._engine_tp = engine_tp
        specs = self._specs = self.group_specs(len(policy_ranks), len(engines))
        addresses = self._wait(
            [
                policy_ranks[spec.sender].weight_group_address.remote(
                    1 + len(spec.engines) * engine_tp, self.backend, self.timeout_s, spec.name
                )
                for spec in specs
            ],
            "choosing weight-sync group addresses",
        )
        joins = []
        # Every engine joins its groups in the same order, so no two groups wait on each other.
        for spec, address in zip(specs, addresses):
            joins.append(policy_ranks[spec.sender].join_weight_group.remote(address, 0))
            joins += [
                engines[e].join_weight_group.remote(address, 1 + j * engine_tp) for j, e in enumerate(spec.engines)
            ]
        self._wait(joins, "forming the weight-sync groups")

    def push(self, version: int) -> SyncReport:
        """Send the policy's current weights to every engine; they report `version` after."""
        t0 = time.perf_counter()
        calls = [rank.run_weight_sync.remote(self, self._engines, version) for rank in self._policy]
        stats = self._wait(calls, f"pushing weight version {version}")
        seconds = time.perf_counter() - t0
        nbytes = sum(int(s.get("bytes", 0)) for s in stats)
        return SyncReport(version, seconds, nbytes, len(self._engines), stats)

    def verify(self, version: int) -> None:
        """Every engine reports the version just pushed (a rollout can then name its weights)."""
        versions = self._wait([e.get_weight_version.remote() for e in self._engines], "reading engine versions")
        stale = [i for i, v in enumerate(versions) if v != version]
        if stale:
            raise WeightSyncError(
                f"engines {stale} report weight versions {[versions[i] for i in stale]}, expected {version}"
            )

    def _wait(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WeightSyncError(
                f"weight sync timed out after {self.timeout_s:.0f}s while {what}; an engine or trainer is stuck "
                f"(raise sync.timeout_s if the model is very large)"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise WeightSyncError(f"an engine or trainer process died while {what}: {one_line(e)}") from e
        except ray.exceptions.RayTaskError as e:
            # A sender's own failure (a peer vanished mid-broadcast): its message, not Ray's
            # traceback and colour codes.
            raise WeightSyncError(f"{what}: {named(e)}") from e

    # ------------------------------------------------------------------ sender side (policy rank)
    def run_send(
        self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int
    ) -> dict[str, Any]:
        """`send`, with transport failures turned into a WeightSyncError that says what happened."""
        try:
            return self.send(weights, group, engines, version, rank)
        except WeightSyncError:
            raise
        except RuntimeError as e:
            # gloo/NCCL report a vanished peer as a RuntimeError ("Connection closed by peer").
            raise WeightSyncError(
                f"weight broadcast from policy rank {rank} failed (an engine probably died): {e}"
            ) from e

    @abc.abstractmethod
    def send(
        self, weights, group: BroadcastGroup | None, engines: list[Any], version: int, rank: int
    ) -> dict[str, Any]:
        """Run inside policy rank `rank`; `group` is None on ranks that do not send."""

    def _engine_calls(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        # Same error translation on the sender side: a dead engine must not hang a trainer rank.
        return self._wait(refs, what)
