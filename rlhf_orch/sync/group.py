"""One broadcast group between the sending trainer rank(s) and every engine worker.

The group is separate from DeepSpeed's default process group: rank 0 (and, for multi-sender
strategies, ranks 0..S-1) are trainer processes, the rest are vLLM workers. The backend named in
`sync.backend` is the one used — there is no silent fallback (OpenRLHF's gloo flag is ignored;
ours is not).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist


#: The broadcast group of single-sender strategies; multi-sender strategies name one per sender.
DEFAULT_GROUP = "rlhf_orch_weights"


@dataclass(frozen=True)
class GroupAddress:
    """Where the group's rendezvous store listens; sent to every member."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    name: str = DEFAULT_GROUP


def free_port_address(world_size: int, backend: str, timeout_s: float, name: str = DEFAULT_GROUP) -> GroupAddress:
    """This node's address (loopback in a local run) and a port free on it (the store binds it next)."""
    host = rendezvous_ip()
    return GroupAddress(host, free_port(host), world_size, backend, timeout_s, name)


# Ports handed out by `free_port`, held bound and listening by this process until its store server
# takes them (`tcp_store`): a port probed free and closed again can be taken by any other process
# before the store binds it (seen in the suite: "OSError: [Errno 98] Address already in use" at start-up).
_RESERVED: dict[tuple[str, int], socket.socket] = {}


def free_port(host: str) -> int:
    """A port at `host`, a local address (bound on `host` itself, not on every interface), held by
    this process for the store server it will serve (`tcp_store(..., is_master=True)` here)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(socket.SOMAXCONN)  # clients that connect early wait in the backlog for the store
    port = sock.getsockname()[1]
    _RESERVED[(host, port)] = sock
    return port


def release_port(host: str, port: int) -> None:
    """Give back a port `free_port` holds (its store server will run in another process)."""
    sock = _RESERVED.pop((host, port), None)
    if sock is not None:
        sock.close()


def tcp_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: timedelta, wait_for_workers: bool = False
) -> dist.TCPStore:
    """A `TCPStore` whose server (`is_master`) listens on `host`:`port` only.

    torch's store server binds every interface (`::`, dual stack) whatever `host` says; given a
    listening socket (`master_listen_fd`) it serves on that one instead, and owns it from then on.
    Clients simply connect to `host`:`port`.
    """
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = _RESERVED.pop((host, port), None)
    try:
        if sock is None:  # a port this process did not hand out: bind it now
            sock = socket.socket(_family(host), socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it goes
    return store


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host`: `host` itself when it is local (loopback stays
    loopback), else the address of the interface that reaches it. Connecting a UDP socket sends nothing."""
    with socket.socket(_family(host), socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_for_address(ip: str) -> Optional[str]:
    """The network interface holding `ip` (e.g. "lo" for 127.0.0.1), for GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME; None when no interface has it."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


def bind_interfaces_towards(host: str) -> Optional[str]:
    """Point gloo's and NCCL's own sockets at the interface that reaches `host` (unless the user set
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME): loopback locally, the cluster NIC on several nodes."""
    iface = interface_for_address(local_address_towards(host))
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if iface and not os.environ.get(key):
            os.environ[key] = iface
    return iface


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def rendezvous_ip() -> str:
    """The address every rendezvous of this process listens on (gloo and NCCL weight groups, the
    trainers' DeepSpeed world): Ray's node IP, reachable from every node of the cluster and
    127.0.0.1 in a local run (launcher=local starts Ray on loopback); outside Ray, loopback alone.
    Never the hostname's resolution, which on many hosts is a loopback address other nodes cannot reach.
    """
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # any failure means "not inside Ray"
        pass
    return "127.0.0.1"


def _gloo_group(store: dist.Store, rank: int, world: int, timeout: timedelta, bind_ip: str) -> dist.ProcessGroup:
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # an explicit choice (launcher=local sets the loopback one)
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    # Otherwise gloo listens on whatever the hostname resolves to; bind the address the others reach us by.
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_ip)]
    return dist.ProcessGroupGloo(store, rank, world, options)


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: timedelta, bind_ip: str) -> dist.ProcessGroup:
    # GPU only: config validation refuses sync.backend=nccl before any actor starts without GPUs.
    # NCCL's own bootstrap sockets follow NCCL_SOCKET_IFNAME (launcher=local sets the loopback one).
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


_GROUP_FACTORIES: dict[str, Callable[[dist.Store, int, int, timedelta, str], dist.ProcessGroup]] = {
    "gloo": _gloo_group,
    "nccl": _nccl_group,
}


class BroadcastGroup:
    """A process group used only for `broadcast(tensor, src)` of weights."""

    def __init__(self, address: GroupAddress, rank: int):
        if address.backend not in _GROUP_FACTORIES:
            raise ValueError(
                f"sync.backend={address.backend!r} is not supported; use one of {sorted(_GROUP_FACTORIES)}"
            )
        timeout = timedelta(seconds=address.timeout_s)
        # Rank 0 hosts the rendezvous store, on address.host only; members joining later is fine.
        self._store = tcp_store(address.host, address.port, address.world_size, rank == 0, timeout)
        prefixed = dist.PrefixStore(address.name, self._store)
        bind_ip = local_address_towards(address.host)
        if address.backend == "nccl":
            bind_interfaces_towards(address.host)  # NCCL's bootstrap follows NCCL_SOCKET_IFNAME
        self.group = _GROUP_FACTORIES[address.backend](prefixed, rank, address.world_size, timeout, bind_ip)
        self.rank = rank
        self.name = address.name
        self.world_size = address.world_size
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else torch.device("cpu")
        )

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Start a broadcast; returns the Work handle (call .wait())."""
        return self.group.broadcast(tensor, src)
