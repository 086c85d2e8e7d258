"""Start Ray inside this process (`ray.init`) and stop it when the session ends.

A local run is reachable from this machine only: Ray's node address is the loopback address, so its
GCS, raylet, object manager, agents and every worker's gRPC server listen on 127.0.0.1, and the
actors' gloo groups (and NCCL's bootstrap sockets) bind the loopback interface (see docs/ports.md).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import ray

from launchers.base import RayLauncher
from rlhf_orch.cuda_probe import cuda_device_count  # torch only where the node has NVIDIA GPUs
from rlhf_orch.topology.placement import MIN_LOGICAL_CPUS

#: The node address of a local run: every Ray process binds it.
LOOPBACK = "127.0.0.1"


class LocalRayLauncher(RayLauncher):
    """A private single-node Ray for this run; `logical_gpus` lets CPU machines test GPU layouts."""

    def __init__(
        self,
        dry_run: bool = False,
        logical_gpus: int = 0,
        num_cpus: Optional[int] = None,
        address: Optional[str] = None,
        startup_timeout_s: float = 600.0,
        reuse_session: bool = False,
        memory_check: str = "refuse",
        keep_actors: bool = False,
        memory_margin: float = 0.05,
    ) -> None:
        if address not in (None, "local"):
            raise ValueError(
                f"launcher.address={address!r} joins an existing cluster, which launcher=local never does: "
                "use launcher=cluster launcher.address=... or leave address null"
            )
        super().__init__(
            dry_run,
            logical_gpus,
            num_cpus,
            address,
            startup_timeout_s,
            reuse_session,
            memory_check,
            keep_actors,
            memory_margin,
        )

    def gpus_present(self) -> int:
        cuda_gpus = cuda_device_count()
        if cuda_gpus == 0 and self.logical_gpus > 0:
            return self.logical_gpus
        return cuda_gpus

    def logical_cpus(self) -> int:
        if self.num_cpus is not None:
            return self.num_cpus
        return max(os.cpu_count() or 1, MIN_LOGICAL_CPUS)

    def _init_kwargs(self) -> dict[str, Any]:
        # address="local" always starts a new instance, never joins one found via RAY_ADDRESS or
        # a `ray start` on this machine (num_cpus/num_gpus are only accepted for a new instance).
        return {
            "address": "local",
            "num_cpus": self.logical_cpus(),
            "num_gpus": self.gpus_present(),
            "include_dashboard": False,
            # No idle workers started ahead for tasks: a run's roles are actors (each its own
            # process); two prestarted workers cost the tiny run ~0.16 GB and ~1.3 CPU-s of its start.
            "_system_config": {"prestart_worker_first_driver": False, "enable_worker_prestart": False},
            "_node_ip_address": LOOPBACK,
            # Job-wide, so every actor (and the libraries in it: DeepSpeed, vLLM) inherits it; an
            # actor's own runtime_env env_vars are merged with these key by key.
            "runtime_env": {"env_vars": loopback_comm_env()},
        }

    def _connect(self) -> None:
        with _loopback_node_address():
            try:
                ray.init(**self._init_kwargs(), **self._output.init_kwargs())
            except RuntimeError as e:
                # Ray's GCS server did not write its port file in time (seen on a loaded 2-core
                # box): a start-up race, not a configuration problem. Start once more.
                if "Timed out waiting for file" not in str(e):
                    raise
                print(f"Ray did not start ({e}); starting it again", flush=True)
                ray.shutdown()
                ray.init(**self._init_kwargs(), **self._output.init_kwargs())
        node_ip = ray.util.get_node_ip_address()
        if node_ip != LOOPBACK:  # session() shuts Ray down on the way out
            raise RuntimeError(
                f"the local Ray node came up on {node_ip}, not {LOOPBACK}: its processes would listen on "
                "the network (this Ray version no longer honours a loopback node address; see docs/ports.md)"
            )


def loopback_comm_env() -> dict[str, str]:
    """Env vars that make torch.distributed's gloo groups and NCCL's bootstrap bind the loopback
    interface (both otherwise take the address the hostname resolves to, or the first non-loopback
    interface). A value already set in this process's environment is left to win."""
    iface = _loopback_interface()
    return {key: iface for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if key not in os.environ}


def _loopback_interface() -> str:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return "lo"


@contextmanager
def _loopback_node_address() -> Iterator[None]:
    """Let `ray.init(_node_ip_address="127.0.0.1")` keep the loopback address.

    `ray.init` passes the node address through `services.resolve_ip_for_localhost`, which replaces a
    loopback address by the machine's outward IP (`get_node_ip_address()`): the processes then
    advertise that IP and Ray's gRPC servers listen on every interface (0.0.0.0 / ::). Only where
    Ray's multi-node mode is off (`ray_constants.ENABLE_RAY_CLUSTER`, the env var
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER read once at import; off by default on macOS/Windows) does
    `get_node_ip_address()` answer the loopback address. It is read at call time, so turning it
    off around `ray.init` makes the node loopback-only; joining a cluster never goes through here.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
