"""An emulated cluster network on one machine (`cluster.network: emulated`, local backend): the driver
builds it, chaos changes its links, and the diagnostics run their pair checks across it.

Each node gets its own network namespace with two links, as a cluster node has a data-plane NIC and a
frontend one. The data link (`eth0`) joins the job's data bridge (198.18.x.0/24) by a veth pair; a
token bucket (tc tbf) on both ends caps it at `cluster.link_gbit` each way, and chaos takes it down or
slows it. The control link (`ctl0`, unlimited) joins the control bridge (198.19.x.0/24), which holds
the job's service address (`host_address`): the embedded Redis and broker listen there, so a node whose
data link is down still heartbeats and takes commands, and its ranks' failure shows as a communication
timeout, as a flapping NIC does on a real cluster. Ranks bind gloo to `eth0`: a peer on another node
is reached through the veths and the data bridge, one on the same node through the namespace's own
loopback (the kernel routes a namespace's own addresses over `lo`). The data bridge's own address
(`switch_address`) is the far end of a node's link, which a self-check probes (diagnostics/loopback.py)
from the node's namespace against a listener in the bridges' namespace, named `host_namespace` for it.

No delay is modelled: this kernel has neither netem nor fq (the qdiscs that can hold a packet back
for a time), and tbf's `latency` only bounds its queue.

Every name derives from the job's name, so whoever ends the job (its supervisor, its driver after
the supervisor was killed, `megascale stop`, or the next start of the same job) finds and removes
them without a record: `teardown(job)`.
"""
from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

CAP_NET_ADMIN = 12
CLONE_NEWNET = 0x40000000
# RFC 2544's benchmarking range (nothing here routes it): data links in the first half, control links in the second.
DATA_POOL, CONTROL_POOL = ipaddress.ip_network("198.18.0.0/16"), ipaddress.ip_network("198.19.0.0/16")
FIRST_NODE_HOST = 10  # node nK gets host number 10 + K in the job's /24
TBF_QUEUE = "50ms"  # how long a packet may wait in the bucket before tbf drops it


class NetworkError(RuntimeError):
    """One line for the user: the emulated network could not be set up or changed."""


@dataclass(frozen=True)
class JobNetwork:
    job: str

    @property
    def tag(self) -> str:
        return hashlib.sha1(self.job.encode()).hexdigest()[:6]

    @property
    def bridge(self) -> str:
        """The data bridge: the nodes' `eth0` links."""
        return f"msbr{self.tag}"

    @property
    def control_bridge(self) -> str:
        return f"mcbr{self.tag}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """The data links' subnet."""
        return _subnet(DATA_POOL, self.tag)

    @property
    def control_subnet(self) -> ipaddress.IPv4Network:
        return _subnet(CONTROL_POOL, self.tag)

    @property
    def host_address(self) -> str:
        """The root namespace's address on the control bridge: where the job's services listen."""
        return str(self.control_subnet[1])

    @property
    def switch_address(self) -> str:
        """The root namespace's address on the data bridge: the far end of every node's data link."""
        return str(self.subnet[1])

    def namespace(self, node: str) -> str:
        return f"ms-{self.tag}-{node}"

    @property
    def host_namespace(self) -> str:
        """A name for the namespace the bridges are in (the creator's), so a probe from a node can reach it."""
        return f"mh-{self.tag}"

    def veth(self, node: str, control: bool = False) -> str:
        """The bridge end of the node's data link (the one chaos acts on), or of its control link."""
        name = f"{'mc' if control else 'ms'}{self.tag}-{node}"
        if len(name) > 15:  # the kernel's limit on interface names
            raise NetworkError(f"node id {node!r} is too long for an emulated link name")
        return name

    def address(self, node: str, control: bool = False) -> str:
        """The node's address on its data link (where its ranks meet their peers), or on its control link."""
        number = int(node[1:]) if node[:1] == "n" and node[1:].isdigit() else -1
        if not 0 <= number < self.subnet.num_addresses - FIRST_NODE_HOST - 1:
            raise NetworkError(f"node {node!r}: the emulated network numbers nodes n0..n"
                               f"{self.subnet.num_addresses - FIRST_NODE_HOST - 2}")
        return str((self.control_subnet if control else self.subnet)[FIRST_NODE_HOST + number])

    def exec_prefix(self, node: str) -> list[str]:
        """Run a command in the node's namespace (`ip netns exec` setns-es, then execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(node)]


def require_net_admin() -> None:
    if not has_net_admin():
        raise NetworkError("cluster.network: emulated needs root (CAP_NET_ADMIN)")
    if not (shutil.which("ip") and shutil.which("tc")):
        raise NetworkError("cluster.network: emulated needs iproute2 (ip, tc) on PATH")


def has_net_admin() -> bool:
    with open("/proc/self/status") as f:
        caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> CAP_NET_ADMIN & 1)


def create(job: str) -> JobNetwork:
    """The job's data and control bridges with their addresses, after removing what an earlier run of it left."""
    require_net_admin()
    net = JobNetwork(job)
    teardown(job)
    for dev, addr in _addresses():
        for subnet in (net.subnet, net.control_subnet):
            if ipaddress.ip_address(addr) in subnet:
                raise NetworkError(f"the emulated network {subnet} of job {job!r} is already on {dev}: rename the job")
    try:
        for bridge, address, subnet in ((net.bridge, net.switch_address, net.subnet),
                                        (net.control_bridge, net.host_address, net.control_subnet)):
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{address}/{subnet.prefixlen}", "dev", bridge)
            _ip("link", "set", bridge, "up")
        _ip("netns", "attach", net.host_namespace, str(os.getpid()))
    except NetworkError:
        teardown(job)
        raise
    return net


def add_node(net: JobNetwork, node: str, gbit: float) -> str:
    """The node's namespace, its data link at `gbit` each way and its control link; returns its data address."""
    ns = net.namespace(node)
    _ip("netns", "add", ns)
    try:
        for control, inner, bridge, subnet in ((False, "eth0", net.bridge, net.subnet),
                                               (True, "ctl0", net.control_bridge, net.control_subnet)):
            veth = net.veth(node, control)
            _ip("link", "add", veth, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{net.address(node, control)}/{subnet.prefixlen}", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        set_rate(net, node, gbit)
    except NetworkError:
        remove_node(net, node)
        raise
    return net.address(node)


def set_rate(net: JobNetwork, node: str, gbit: float) -> None:
    """Caps the node's link at `gbit` each way: its egress in the namespace, its ingress on the bridge side."""
    bits = int(gbit * 1e9)
    # The bucket must hold a whole 64 KB GSO packet (or tbf drops it and the link stalls) and a couple
    # of milliseconds at full rate (or the kernel's timer granularity caps the rate below `gbit`).
    burst = max(256 * 1024, bits // 8 // 500)
    tbf = ["root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", TBF_QUEUE]
    _run(["tc", "-n", net.namespace(node), "qdisc", "replace", "dev", "eth0", *tbf])
    _run(["tc", "qdisc", "replace", "dev", net.veth(node), *tbf])


def set_link(net: JobNetwork, node: str, up: bool) -> None:
    """Takes the node's data link down (its cable pulled) or back up; its control link stays."""
    _ip("link", "set", net.veth(node), "up" if up else "down")


def remove_node(net: JobNetwork, node: str) -> None:
    """Removes the node's namespace; its veth pair and qdiscs go with it once no process is left inside."""
    if net.namespace(node) in _namespaces():
        _ip("netns", "del", net.namespace(node))


def teardown(job: str) -> None:
    """Removes every namespace, veth and bridge of `job` (idempotent; a no-op if there are none)."""
    if not shutil.which("ip"):
        return  # without iproute2 no job made one
    net = JobNetwork(job)
    for ns in _namespaces():
        if ns.startswith(f"ms-{net.tag}-") or ns == net.host_namespace:  # the latter: only its name goes
            _ip("netns", "del", ns)
    for link in leftovers(job):
        if not link.startswith(("ms-", "mh-")):
            _run(["ip", "link", "del", link], check=False)  # a veth may vanish with its namespace meanwhile


def leftovers(job: str) -> list[str]:
    """Names of the job's namespaces and links that exist now."""
    tag = JobNetwork(job).tag
    links = [link["ifname"] for link in _json(["ip", "-j", "link", "show"])]
    return [n for n in _namespaces() if n.startswith((f"ms-{tag}-", f"mh-{tag}"))] + [
        n for n in links if n.startswith((f"ms{tag}-", f"mc{tag}-", f"msbr{tag}", f"mcbr{tag}"))]


def nodes(job: str) -> list[str]:
    """Ids of the job's nodes that have a namespace now."""
    prefix = f"ms-{JobNetwork(job).tag}-"
    return [ns[len(prefix):] for ns in _namespaces() if ns.startswith(prefix)]


def data_link_here() -> Optional[tuple[str, str, str]]:
    """(its address, the far end's, the far end's namespace) of the data link of the emulated node whose
    namespace this thread is in; None elsewhere."""
    mine = os.stat("/proc/thread-self/ns/net").st_ino
    node_ns = next((ns for ns in _namespaces() if ns.startswith("ms-") and os.stat(f"/run/netns/{ns}").st_ino == mine),
                   None)
    found = [a for dev in _json(["ip", "-j", "-4", "addr", "show", "dev", "eth0"]) for a in dev.get("addr_info", [])
             ] if node_ns else []
    if not found:
        return None
    link = ipaddress.ip_interface(f"{found[0]['local']}/{found[0]['prefixlen']}")
    return str(link.ip), str(link.network[1]), f"mh-{node_ns.split('-')[1]}"


def enter(namespace: str) -> None:
    """This thread into `namespace` for good, threads it starts after too: a rank process placed on a node, a
    probe's far end on the host."""
    there = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(there, namespace)
    finally:
        os.close(there)


@contextmanager
def inside(namespace: str) -> Iterator[None]:
    """This thread in `namespace` (threads it starts meanwhile too); sockets made here stay there after."""
    home, there = os.open("/proc/thread-self/ns/net", os.O_RDONLY), os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(there, namespace)
        try:
            yield
        finally:
            _setns(home, "the original namespace")
    finally:
        os.close(home)
        os.close(there)


def _setns(fd: int, name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET):
        raise NetworkError(f"cannot enter network namespace {name}: {os.strerror(ctypes.get_errno())}")


def _subnet(pool: ipaddress.IPv4Network, tag: str) -> ipaddress.IPv4Network:
    subnets = list(pool.subnets(new_prefix=24))
    return subnets[int(tag, 16) % len(subnets)]


def _namespaces() -> list[str]:
    return [entry["name"] for entry in _json(["ip", "-j", "netns", "list"])]


def _addresses() -> list[tuple[str, str]]:
    return [(dev["ifname"], a["local"]) for dev in _json(["ip", "-j", "-4", "addr", "show"])
            for a in dev.get("addr_info", [])]


def _json(argv: list[str]) -> list[dict]:
    out = _run(argv).stdout.strip()
    return json.loads(out) if out else []  # `ip -j netns list` prints nothing when there are none


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode:
        raise NetworkError(f"`{' '.join(argv)}` failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done
