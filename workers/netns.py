"""A node that can be partitioned for real: a network namespace joined to this host by a veth pair
on its own /30, for a node agent to run in (tests, benches). Root only, Linux `ip` only.

    with Partitionable.create("p1", index=7) as net:      # 10.213.7.1 (host) <-> 10.213.7.2 (namespace)
        DevStack(..., ip=net.host_ip, interface=net.host_if).start_agent("n2", netns=net)
        net.cut()       # the namespace side of the link goes down: every packet across it is dropped
        net.restore()

A cut never falls back to the default route: a blackhole route for the subnet is added before the
link exists (the connected route wins while the link is up), and the cut takes the namespace side
down, so the host keeps its route to the subnet and drops what it sends there. The namespace has no
default route: it reaches the host's side of the link and nothing else. `close` removes namespace,
veth and route.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType


def usable() -> str | None:
    """Why partitions cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


@dataclass
class Partitionable:
    name: str  # the namespace's, and the stem of its veth pair's (short: interface names end at 15)
    index: int  # which /30 of 10.213.0.0/16: one per namespace, so two never share a subnet

    @property
    def subnet(self) -> str:
        return f"10.213.{self.index}.0/30"

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.index}.1"

    @property
    def ns_ip(self) -> str:
        return f"10.213.{self.index}.2"

    @property
    def host_if(self) -> str:
        return f"{self.name}-h"[:15]

    @property
    def ns_if(self) -> str:
        return f"{self.name}-n"[:15]

    def exec_prefix(self) -> list[str]:
        """What runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    @classmethod
    def create(cls, name: str, index: int) -> Partitionable:
        net = cls(name, index)
        if _ip("route", "show", "table", "all", net.subnet).stdout.strip():
            raise RuntimeError(f"{net.subnet} is routed already: choose another index")
        try:
            _ip("route", "add", "blackhole", net.subnet, "metric", "1000")  # first: a cut must never leak
            _ip("netns", "add", name)
            _ip("link", "add", net.host_if, "type", "veth", "peer", "name", net.ns_if)
            _ip("link", "set", net.ns_if, "netns", name)
            _ip("addr", "add", f"{net.host_ip}/30", "dev", net.host_if)
            _ip("link", "set", net.host_if, "up")
            _ip("netns", "exec", name, "ip", "addr", "add", f"{net.ns_ip}/30", "dev", net.ns_if)
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
            _ip("netns", "exec", name, "ip", "link", "set", net.ns_if, "up")
        except BaseException:
            net.close()
            raise
        return net

    def cut(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_if, "down")

    def restore(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_if, "up")

    def close(self) -> None:
        """Namespace, veth pair (its peer goes with the namespace) and route; what is gone already is skipped."""
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_if, check=False)
        _ip("route", "del", "blackhole", self.subnet, "metric", "1000", check=False)

    def __enter__(self) -> Partitionable:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


@dataclass
class Segment:
    """Several hosts on one network: a namespace each, joined by veth pairs to a bridge on this host,
    all in 10.214.<index>.0/24 (the host is .1, host i is .(i+2)). Inside each namespace the link is
    `eth0`, as on a real host. Every host reaches the others and this host, nothing else.

        with Segment.create("sa", index=3, hosts=["c1", "c2"]) as net:   # sa-c1: 10.214.3.2, sa-c2: .3
            subprocess.run([*net.exec_prefix("c1"), "hostname"])
    """

    prefix: str  # of the bridge's and the namespaces' names (short: interface names end at 15)
    index: int  # which /24 of 10.214.0.0/16
    hosts: list[str]

    @property
    def subnet(self) -> str:
        return f"10.214.{self.index}.0/24"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"[:15]

    @property
    def host_ip(self) -> str:
        return f"10.214.{self.index}.1"

    def ip(self, host: str) -> str:
        return f"10.214.{self.index}.{self.hosts.index(host) + 2}"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _veth(self, host: str) -> str:
        return f"{self.prefix}-{host}"[:15]

    def exec_prefix(self, host: str) -> list[str]:
        """What runs a command inside `host`'s namespace. Only the network is its own: `nsenter --net`
        keeps this host's mounts, where `ip netns exec` remounts /sys (and a daemon that reads its
        cgroups there, slurmd, then fails to start)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(host)}"]

    @classmethod
    def create(cls, prefix: str, index: int, hosts: list[str]) -> Segment:
        net = cls(prefix, index, hosts)
        if _ip("route", "show", "table", "all", net.subnet).stdout.strip():
            raise RuntimeError(f"{net.subnet} is routed already: choose another index")
        try:
            _ip("route", "add", "blackhole", net.subnet, "metric", "1000")  # nothing for it ever leaves the host
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.host_ip}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for host in hosts:
                ns = net.namespace(host)
                _ip("netns", "add", ns)
                _ip("link", "add", net._veth(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", net._veth(host), "master", net.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{net.ip(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            net.close()
            raise
        return net

    def close(self) -> None:
        for host in self.hosts:
            _ip("netns", "del", self.namespace(host), check=False)
            _ip("link", "del", self._veth(host), check=False)
        _ip("link", "del", self.bridge, check=False)
        _ip("route", "del", "blackhole", self.subnet, "metric", "1000", check=False)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
