"""NIC loopback: bandwidth and latency through each interface.

On RDMA hosts with perftest installed this runs `ib_write_bw` against itself on the interface's
device. Otherwise it is TCP to the interface's own address; Linux routes that inside the kernel,
so it measures the host's network stack (and any qdisc on the path), not the NIC's wire.

A node on an emulated network (megascale/common/netemu.py) has a wire to measure: its data link is probed
to its far end, the data bridge's address on the host (`link_bandwidth`, `link_latency`), down or not, so a
pulled cable or a slow link fails that node's check (the link is left out of the own-address rows).
"""
from __future__ import annotations

import os
import re
import select
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import psutil

from megascale.common import netemu
from megascale.config import ConfigError

from .config import DiagnosticsConfig, NodeSpec
from .faults import Faults, RateLimitedProxy
from .report import FAIL, CheckResult

_CHUNK = 1 << 20
_PING = 64


def interfaces(names: tuple[str, ...] | None) -> list[tuple[str, str]]:
    """(name, IPv4 address) of the requested interfaces, or of every up interface with IPv4."""
    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    found = {}
    for name, entries in addrs.items():
        ipv4 = [a.address for a in entries if a.family == socket.AF_INET]
        if ipv4 and (names is not None or (name in stats and stats[name].isup)):
            found[name] = ipv4[0]
    if names is None:
        return sorted(found.items())
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(f"interfaces: {','.join(missing)} not found or without IPv4 (have {','.join(sorted(found))})")
    return [(n, found[n]) for n in names]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return b""
        data += part
    return data


def tcp_loopback(connect: tuple[str, int], window_s: float, max_bytes: int, timeout_s: float,
                 rounds: int = 3) -> tuple[float, float]:
    """(bandwidth GB/s, one-way latency us) against a `_Sink` (or a proxy in front of one) at `connect`.

    Best of `rounds` for each: a persistent fault shows in every round, a noisy neighbour rarely does.
    """
    latency = min(_pings(connect, window_s * 0.25 / rounds, timeout_s) for _ in range(rounds))
    _bulk(connect, window_s * 0.1, max_bytes, timeout_s)  # warm-up: the first transfer runs slow
    bandwidth = max(_bulk(connect, window_s * 0.65 / rounds, max_bytes, timeout_s) for _ in range(rounds))
    return bandwidth, latency


def _pings(connect: tuple[str, int], window_s: float, timeout_s: float) -> float:
    """Median one-way latency (RTT / 2, us) of 64-byte ping-pongs over one connection.

    Both ends busy-poll: a blocking receive measures the CPU's wake-up time (tens of us on a VM,
    varying run to run) rather than the path's latency.
    """
    with socket.create_connection(connect, timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"P")
        s.setblocking(False)
        msg, rtts, end = b"x" * _PING, [], time.perf_counter() + window_s
        while len(rtts) < 5 or (len(rtts) < 1000 and time.perf_counter() < end):
            t0 = time.perf_counter()
            s.sendall(msg)
            got, give_up = 0, t0 + timeout_s
            while got < _PING:
                try:
                    part = s.recv(_PING - got)
                except BlockingIOError:
                    if time.perf_counter() > give_up:
                        raise TimeoutError(f"no ping echo within {timeout_s:g} s") from None
                    os.sched_yield()
                    continue
                if not part:
                    raise ConnectionError("ping echo closed early")
                got += len(part)
            rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) / 2 * 1e6


def _bulk(connect: tuple[str, int], window_s: float, max_bytes: int, timeout_s: float) -> float:
    """GB/s of one connection that sends for `window_s` (or `max_bytes`) and waits for the count."""
    payload = memoryview(bytes(_CHUNK))
    with socket.create_connection(connect, timeout=timeout_s) as s:
        s.sendall(b"B")
        sent, t0 = 0, time.perf_counter()
        end = t0 + window_s
        while sent < max_bytes and (sent == 0 or time.perf_counter() < end):
            s.sendall(payload)
            sent += _CHUNK
        s.shutdown(socket.SHUT_WR)
        got = struct.unpack("!Q", _recv_exact(s, 8))[0]
        took = time.perf_counter() - t0
    if got != sent:
        raise ConnectionError(f"sent {sent} bytes, receiver counted {got}")
    return got / took / 1e9


def rdma_device(interface: str) -> str | None:
    """The RDMA device behind a netdev (e.g. mlx5_0 for ib0), if any."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return None
    for dev in root.iterdir():
        if (dev / "device" / "net" / interface).exists():
            return dev.name
    return None


def parse_ib_write_bw(text: str) -> float:
    """GB/s from perftest's result table (`BW average[MB/sec]` or `[Gb/sec]` with --report_gbits)."""
    header = re.search(r"BW average\[(MB|Gb)/sec\]", text)
    if not header:
        raise ValueError("no 'BW average' column in ib_write_bw output")
    for line in text[header.end():].splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0].isdigit():
            avg = float(cols[3])
            return avg / 1e3 if header.group(1) == "MB" else avg / 8
    raise ValueError("no result row in ib_write_bw output")


def ib_write_bw_loopback(device: str, address: str, seconds: int, timeout_s: float) -> float:
    exe = shutil.which("ib_write_bw")
    with socket.socket() as probe:  # a free TCP port for perftest's out-of-band exchange
        probe.bind((address, 0))
        port = str(probe.getsockname()[1])
    args = [exe, "-d", device, "-p", port, "-D", str(seconds), "-F"]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.3)  # perftest has no readiness signal; the client retries nothing
        client = subprocess.run([*args, address], capture_output=True, text=True, timeout=timeout_s, check=False)
        if client.returncode != 0:
            raise RuntimeError(f"ib_write_bw exited {client.returncode}: {client.stdout.strip().splitlines()[-1:]}")
        return parse_ib_write_bw(client.stdout)
    finally:
        server.kill()
        server.wait()


def check_loopback(node: NodeSpec, config: DiagnosticsConfig, faults: Faults, budget_s: float) -> list[CheckResult]:
    """Rows of every interface; measured from the node's network namespace when it has one (`diagnose --job`)."""
    with netemu.inside(node.netns) if node.netns else nullcontext():
        link = netemu.data_link_here()
        rows = _link_rows(node, link, config, budget_s) if link else []
        for name, address in interfaces(node.interfaces or config.interfaces):
            if not link or address != link[0]:
                rows += _interface_rows(node, name, address, config, faults, budget_s)
    return rows


def _link_rows(node: NodeSpec, link: tuple[str, str, str], config: DiagnosticsConfig, budget_s: float
               ) -> list[CheckResult]:
    """The emulated data link, from this end to a sink on the host at its far end."""
    t0 = time.perf_counter()
    target = f"eth0->{link[1]}"
    bw = CheckResult("loopback", "link_bandwidth", [node.node_id], target, None, "GB/s", budget_s=budget_s)
    lat = CheckResult("loopback", "link_latency", [node.node_id], target, None, "us", budget_s=budget_s)
    try:
        with Sink(link[1], timeout_s=budget_s, netns=link[2]) as sink:
            bandwidth, latency = tcp_loopback(sink.address, budget_s * 0.6, int(config.loopback_mb * 2**20), budget_s)
        bw.value, lat.value = round(bandwidth, 4), round(latency, 2)
        bw.detail = lat.detail = f"tcp {link[0]} -> {link[1]} across the node's link"
    except Exception as e:  # noqa: BLE001 - a link that is down fails these rows only
        why = f"the link to {link[1]} is down or stalled: {type(e).__name__}: {e}".splitlines()[0]
        for row in (bw, lat):
            row.status, row.detail = FAIL, why
    bw.elapsed_s = lat.elapsed_s = time.perf_counter() - t0
    return [bw, lat]


def _interface_rows(node: NodeSpec, name: str, address: str, config: DiagnosticsConfig, faults: Faults,
                    budget_s: float) -> list[CheckResult]:
    t0 = time.perf_counter()
    bw = CheckResult("loopback", "bandwidth", [node.node_id], name, None, "GB/s", budget_s=budget_s)
    lat = CheckResult("loopback", "latency", [node.node_id], name, None, "us", budget_s=budget_s)
    # An injected throttle is a TCP proxy, so a faulted node measures over TCP even on RDMA.
    ibdev = rdma_device(name) if shutil.which("ib_write_bw") and not faults.loopback_rate else None
    try:
        if ibdev:
            bw.value = ib_write_bw_loopback(ibdev, address, max(1, int(budget_s / 2)), budget_s)
            lat.value = _tcp(address, budget_s * 0.3, config, faults)[1]
            bw.detail, lat.detail = f"ib_write_bw -d {ibdev}", f"tcp {address} ping-pong"
        else:
            bw.value, lat.value = _tcp(address, budget_s, config, faults)
            via = " via rate-limited proxy (injected)" if faults.loopback_rate else ""
            bw.detail = lat.detail = f"tcp {address}{via}"
        bw.value, lat.value = round(bw.value, 4), round(lat.value, 2)
    except Exception as e:  # noqa: BLE001 - a dead interface or a stalled transfer fails this row only
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        for row in (bw, lat):
            row.status, row.detail = FAIL, why
    bw.elapsed_s = lat.elapsed_s = time.perf_counter() - t0
    return [bw, lat]


class Sink:
    """The receiving end in its own process, so it does not share a GIL or a core with the sender."""

    def __init__(self, address: str, timeout_s: float, netns: str | None = None) -> None:
        """`netns`: the named network namespace to listen in, if not this thread's."""
        script = Path(__file__).with_name("_sink.py")
        self.proc = subprocess.Popen([sys.executable, str(script), address, str(timeout_s)],
                                     stdout=subprocess.PIPE, text=True,
                                     preexec_fn=(lambda: netemu.enter(netns)) if netns else None)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"loopback sink on {address} did not start")
        self.address = (address, int(line))

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def _tcp(address: str, budget_s: float, config: DiagnosticsConfig, faults: Faults) -> tuple[float, float]:
    window = budget_s * 0.6  # the rest covers start-up and buffered bytes draining after the window
    with Sink(address, timeout_s=budget_s) as sink:
        proxy = RateLimitedProxy(sink.address, faults.loopback_rate) if faults.loopback_rate else None
        try:
            target = proxy.address if proxy else sink.address
            return tcp_loopback(target, window, int(config.loopback_mb * 2**20), budget_s)
        finally:
            if proxy:
                proxy.close()

