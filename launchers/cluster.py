"""Join a running Ray cluster (`ray start --head` / Slurm template / Ray Job); never stop it."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Optional

import ray

from launchers.base import RayLauncher

# Seconds a TCP connect to the cluster's address may take before it counts as unreachable:
# `ray.init` itself can wait much longer (or hang) on an address nobody answers.
PROBE_TIMEOUT_S = 5.0
RAY_CLIENT_DEFAULT_PORT = 10001


class ClusterRayLauncher(RayLauncher):
    """Connects with `ray.init(address=...)`; leaving the session only disconnects this driver.

    The cluster's resources are fixed by `ray start`, so `logical_gpus` and `num_cpus` are refused
    here rather than silently ignored. `gpus_present()` / `cuda_present()` read the cluster: inside
    `session()` they use that connection, outside it one connection just long enough to ask (config
    checks run before the session).
    Before every `ray.init` the address is resolved and probed (`check_reachable`), so an unreachable
    cluster is a `ConnectionError` within seconds rather than a hang.
    """

    def __init__(
        self,
        dry_run: bool = False,
        logical_gpus: int = 0,
        num_cpus: Optional[int] = None,
        address: Optional[str] = "auto",
        startup_timeout_s: float = 600.0,
        reuse_session: bool = False,
        memory_check: str = "refuse",
        keep_actors: bool = False,
        memory_margin: float = 0.05,
    ) -> None:
        if logical_gpus:
            raise ValueError(
                f"launcher.logical_gpus={logical_gpus} cannot be applied to a running cluster: "
                "give `ray start --num-gpus=N` on each node instead, or use launcher=local"
            )
        if num_cpus is not None:
            raise ValueError(
                f"launcher.num_cpus={num_cpus} cannot be applied to a running cluster: "
                "give `ray start --num-cpus=N` on each node instead, or use launcher=local"
            )
        super().__init__(
            dry_run,
            logical_gpus,
            num_cpus,
            address or "auto",
            startup_timeout_s,
            reuse_session,
            memory_check,
            keep_actors,
            memory_margin,
        )
        self._asked: Optional[list[dict[str, float]]] = None  # the nodes' resources, read outside a session

    def gpus_present(self) -> int:
        return int(sum(node.get("GPU", 0) for node in self._node_resources()))

    def cuda_present(self) -> bool:
        """The cluster's GPUs are real where Ray detected their type on a node that offers them,
        whatever the driver's machine has: a CPU-only head node (or a login node) drives a GPU
        cluster. Where Ray typed none (its detection failed), this machine's answer, as before."""
        return any(detected_gpus(node) for node in self._node_resources()) or super().cuda_present()

    def _node_resources(self) -> list[dict[str, float]]:
        """Each alive node's resources (read once outside a session: the checks ask twice)."""
        if ray.is_initialized():
            return _alive_nodes()
        if self._asked is None:
            with self.session():
                self._asked = _alive_nodes()
        return self._asked

    def _init_kwargs(self) -> dict[str, Any]:
        check_reachable(self.address)
        return {"address": self.address}


def resolve_address(address: Optional[str]) -> tuple[str, int]:
    """(host, port) that `ray.init(address=...)` will connect to, found the way Ray finds it.

    "auto" (or None): RAY_ADDRESS, else the cluster this machine's last `ray start` recorded (Ray's
    `ray_current_cluster` file), else a running GCS process on this machine; ConnectionError when
    there is none. "ray://host[:port]": the Ray Client server. "host:port": the GCS.
    """
    addr = address
    env = os.environ.get("RAY_ADDRESS")
    if env and addr in (None, "auto"):
        addr = env  # ray.init does the same
    if addr in (None, "auto"):
        from ray._private import services

        try:
            found = services.canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError):  # none found, or an unreadable record of one
            found = None
        if not found:
            raise ConnectionError(
                "launcher.address='auto' found no Ray cluster: RAY_ADDRESS is not set, this machine has no "
                "`ray start` record and no running Ray; start one with `ray start --head` or set "
                "launcher.address=<head-ip>:6379"
            )
        addr = found
    scheme, sep, rest = addr.partition("://")
    if sep:
        if scheme != "ray":
            raise ValueError(
                f"launcher.address={address!r}: only 'auto', '<host>:<port>' (the GCS) or 'ray://<host>:<port>' "
                "(Ray Client) can be joined"
            )
        host, port = _split_host_port(rest, address, default_port=RAY_CLIENT_DEFAULT_PORT)
    else:
        host, port = _split_host_port(addr, address, default_port=None)
    return host, port


def _split_host_port(hostport: str, address: Optional[str], default_port: Optional[int]) -> tuple[str, int]:
    hostport = hostport.strip().rstrip("/")
    host, port_text = hostport, ""
    if hostport.startswith("["):  # [IPv6]:port
        host, _, tail = hostport[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
    if port_text == "" and default_port is not None:
        port_text = str(default_port)
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"launcher.address={address!r} is not '<host>:<port>' (e.g. 10.0.0.1:6379), 'ray://<host>:<port>' or 'auto'"
        )
    return host, int(port_text)


def check_reachable(address: Optional[str], timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """ConnectionError unless something accepts TCP connections at the cluster's address within `timeout_s`.

    The connect (name resolution included) runs in a daemon thread so a stuck DNS lookup cannot
    hold the caller past the timeout either.
    """
    host, port = resolve_address(address)
    outcome: dict[str, BaseException | None] = {}

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                outcome["error"] = None
        except BaseException as e:  # reported to the caller below
            outcome["error"] = e

    thread = threading.Thread(target=probe, name="ray-address-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    if "error" not in outcome:
        raise ConnectionError(f"no answer from {host}:{port} within {timeout_s:g} s; {_HINT}")
    error = outcome["error"]
    if error is None:
        return
    if isinstance(error, socket.timeout):
        raise ConnectionError(f"no answer from {host}:{port} within {timeout_s:g} s; {_HINT}") from None
    if isinstance(error, socket.gaierror):
        raise ConnectionError(f"cannot resolve host {host!r} ({error.strerror or error}); {_HINT}") from None
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    raise ConnectionError(f"nothing accepts connections at {host}:{port} ({reason}); {_HINT}") from None


_HINT = (
    "check that the head node runs (`ray status` there) and that launcher.address names its GCS address "
    "(<head-ip>:6379 by default) or its Ray Client address (ray://<head-ip>:10001)"
)


def _alive_nodes() -> list[dict[str, float]]:
    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def detected_gpus(resources: dict[str, float]) -> bool:
    """One node offers GPUs whose type Ray detected (the `accelerator_type:<type>` resource a node's
    real devices add: `ray start --num-gpus=N` on a machine without any declares logical ones, untyped)."""
    return resources.get("GPU", 0) > 0 and any(k.startswith("accelerator_type:") for k in resources)
