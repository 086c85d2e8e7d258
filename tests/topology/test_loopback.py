"""A local run listens on the loopback address only.

`launcher=local` starts Ray the way a run does; two actors open the weight-sync gloo group
(`free_port_address` + `BroadcastGroup`) and, with it alive, every listening socket of the
session's processes (the driver and all its descendants: GCS, raylet, agents, workers) must be
bound to 127.0.0.0/8 or ::1. 0.0.0.0 and :: (every interface) and the machine's own addresses fail.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest
import ray

from launchers.local import LocalRayLauncher

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@ray.remote(num_cpus=1)
class Member:
    """One member of a weight-sync broadcast group."""

    def pid(self) -> int:
        return os.getpid()

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def group_address(self, world_size: int):
        from rlhf_orch.sync.group import free_port_address

        return free_port_address(world_size, "gloo", 30.0)

    def join(self, address, rank: int) -> int:
        from rlhf_orch.sync.group import BroadcastGroup

        self.group = BroadcastGroup(address, rank)
        return rank

    def broadcast(self, value: float) -> list[float]:
        import torch

        tensor = torch.full((4,), value)
        self.group.broadcast(tensor, 0).wait()
        return tensor.tolist()


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, an IPv6 socket bound to IPv4 loopback
    return address.is_loopback


def session_listeners() -> list[tuple[str, int, int, str]]:
    """(ip, port, pid, process) of every TCP/UDP socket in LISTEN state held by this process or a descendant."""
    me = psutil.Process()
    procs = {p.pid: p for p in me.children(recursive=True)}
    procs[me.pid] = me
    rows = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs and conn.laddr:
            try:
                name = " ".join(procs[conn.pid].cmdline()[:2])[-80:]
            except psutil.Error:
                name = "?"
            rows.append((conn.laddr.ip, conn.laddr.port, conn.pid, name))
    return rows


def loopback_interfaces() -> set[str]:
    return {
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and is_loopback(a.address) for a in addrs)
    }


def test_local_session_listens_on_loopback_only() -> None:
    launcher = LocalRayLauncher(num_cpus=4)
    with launcher.session():
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        # Actors bring env_vars of their own (as start_role_actors does), merged key by key with the
        # job's. Rank 1 clears GLOO_SOCKET_IFNAME, so both of BroadcastGroup's ways of choosing gloo's
        # address (the env var; else the address on the route to the store) are exercised.
        members = [
            Member.options(runtime_env={"env_vars": {"RLHF_ORCH_LOOPBACK_PROBE": "1"}}).remote(),
            Member.options(runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": ""}}).remote(),
        ]
        assert ray.get([m.node_ip.remote() for m in members], timeout=60) == ["127.0.0.1", "127.0.0.1"]
        assert ray.get(members[0].env.remote("RLHF_ORCH_LOOPBACK_PROBE")) == "1"
        if "GLOO_SOCKET_IFNAME" not in os.environ:  # launcher=local points the actors' gloo at loopback
            assert ray.get(members[0].env.remote("GLOO_SOCKET_IFNAME")) in loopback_interfaces()
        assert ray.get(members[1].env.remote("GLOO_SOCKET_IFNAME")) == ""

        address = ray.get(members[0].group_address.remote(2), timeout=30)
        assert address.host == "127.0.0.1"
        ray.get([m.join.remote(address, rank) for rank, m in enumerate(members)], timeout=60)
        assert (
            ray.get([m.broadcast.remote(float(rank + 7)) for rank, m in enumerate(members)], timeout=60)
            == [[7.0] * 4] * 2
        )

        listeners = session_listeners()
        member_pids = set(ray.get([m.pid.remote() for m in members]))
        pids = {pid for _, _, pid, _ in listeners}
        # Not vacuous: the driver, Ray's daemons and both members (their gRPC servers, the store and
        # gloo's pair listeners) are among what was looked at.
        assert os.getpid() in pids and member_pids <= pids, listeners
        assert any("gcs_server" in name for *_, name in listeners) and any("raylet" in name for *_, name in listeners)
        assert any(port == address.port and pid in member_pids for _, port, pid, _ in listeners), listeners

        exposed = [row for row in listeners if not is_loopback(row[0])]
        assert not exposed, "listening beyond loopback (ip, port, pid, process):\n" + "\n".join(map(str, exposed))
