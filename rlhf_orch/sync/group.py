"""One broadcast group between the sending trainer rank(s) and every engine worker.

The group is separate from DeepSpeed's default process group: rank 0 (and, for multi-sender
strategies, ranks 0..S-1) are trainer processes, the rest are vLLM workers. The backend named in
`sync.backend` is the one used — there is no silent fallback (OpenRLHF's gloo flag is ignored;
ours is not).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

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
    """An address on this host with a port nobody is listening on (taken by the store next)."""
    host = socket.gethostbyname(socket.gethostname()) if backend == "nccl" else _reachable_ip()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return GroupAddress(host, port, world_size, backend, timeout_s, name)


def _reachable_ip() -> str:
    # Ray's node IP is reachable from every node of the cluster; fall back to loopback alone.
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - any failure means "not inside Ray"
        pass
    return "127.0.0.1"


def _gloo_group(store: dist.Store, rank: int, world: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: timedelta) -> dist.ProcessGroup:
    # GPU only: config validation refuses sync.backend=nccl before any actor starts without GPUs.
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


_GROUP_FACTORIES: dict[str, Callable[[dist.Store, int, int, timedelta], dist.ProcessGroup]] = {
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
        # Rank 0 hosts the rendezvous store; members joining later is fine (wait_for_workers=False).
        self._store = dist.TCPStore(
            address.host,
            address.port,
            address.world_size,
            is_master=(rank == 0),
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(address.name, self._store)
        self.group = _GROUP_FACTORIES[address.backend](prefixed, rank, address.world_size, timeout)
        self.rank = rank
        self.name = address.name
        self.world_size = address.world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast; returns the Work handle (call .wait())."""
        return self.group.broadcast(tensor, src)
