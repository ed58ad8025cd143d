"""A real throttled NIC path: a network namespace whose loopback has a token-bucket qdisc (tc tbf), and
an all-reduce pair across an emulated network's bridge (megascale/common/netemu.py).

Needs root, iproute2 and the kernel's tbf qdisc; skips with the reason otherwise. The rate-limited
TCP proxy fault in test_suite.py covers the same failure without privileges.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.common import netemu
from megascale.diagnostics.cli import main as diagnose_main
from megascale.diagnostics import NodeSpec
from megascale.diagnostics.collectives import RankSpec, run_collective
from megascale.diagnostics.faults import Faults
from megascale.diagnostics.loopback import check_loopback

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megascale.diagnostics.cli", "diagnose", "--json", "--checks", "loopback",
       "--interfaces", "lo", "--set", "budgets.loopback=1", "--set", "thresholds.loopback.bandwidth.expected=0.2"]


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def netns():
    """Yields a factory for namespaces with lo up (and a tbf rate, if given); removes them after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("iproute2 (ip, tc) not installed")
    made = []

    def make(rate: str | None) -> str:
        name = f"msdiag-{os.getpid()}-{len(made)}"
        add = sh("ip", "netns", "add", name)
        if add.returncode:
            pytest.skip(f"cannot create a network namespace: {add.stderr.strip()}")
        made.append(name)
        up = sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        if up.returncode:
            pytest.skip(f"cannot enter a network namespace: {up.stderr.strip()}")
        if rate:
            # burst must exceed lo's 64 KB GSO packets, or tbf drops them and the link stalls.
            tbf = sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                     "rate", rate, "burst", "256kb", "latency", "100ms")
            if tbf.returncode:
                pytest.skip(f"tc tbf unavailable: {tbf.stderr.strip()}")
        return name

    yield make
    for name in made:
        sh("ip", "netns", "del", name)


def diagnose_in(ns: str) -> tuple[int, dict]:
    proc = subprocess.run(["ip", "netns", "exec", ns, *CLI], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_tc_throttled_loopback_fails_and_clean_one_passes(netns):
    throttled, clean = netns("100mbit"), netns(None)
    code, report = diagnose_in(throttled)
    bw = next(r for r in report["checks"] if r["metric"] == "bandwidth")
    assert code == 1 and bw["status"] == "fail" and bw["baseline_source"] == "configured"
    assert bw["value"] == pytest.approx(0.0125, rel=0.3)  # 100 Mbit/s = 12.5 MB/s
    code, report = diagnose_in(clean)
    bw = next(r for r in report["checks"] if r["metric"] == "bandwidth")
    assert code == 0 and bw["status"] == "pass" and bw["value"] > 0.1


@pytest.fixture
def emulated_net():
    """An emulated network of this test's own (namespaces, veths, bridge), removed after it."""
    try:
        netemu.require_net_admin()
    except netemu.NetworkError as e:
        pytest.skip(str(e))
    job = f"emu-diag-{os.getpid()}"
    net = netemu.create(job)
    try:
        yield net
    finally:
        netemu.teardown(job)
    assert netemu.leftovers(job) == []


def test_a_diagnostics_all_reduce_pair_crosses_the_bridge_at_the_slow_link_rate(emulated_net):
    """What `megascale diagnose --job JOB` runs for each pair: one rank in each node's namespace."""
    netemu.add_node(emulated_net, "n0", 2)
    netemu.add_node(emulated_net, "n1", 0.2)  # 25 MB/s: the pair's bus bandwidth cannot exceed it
    ranks = [RankSpec(n, 0, 0, netns=emulated_net.namespace(n)) for n in ("n0", "n1")]
    res = run_collective("all_reduce", ranks, 2**20, budget_s=1.5, timeout_s=10, backend="gloo",
                         spawn_grace_s=30, store_host=emulated_net.host_address)
    assert res.ok, res.error
    assert 0.008 < res.bus_bandwidth("all_reduce", 2**20, 2) < 0.03  # GB/s


def test_the_loopback_check_probes_an_emulated_nodes_link_at_its_rate_and_fails_it_when_down(fast_config,
                                                                                            emulated_net):
    """What the self-check before a restart runs on an emulated node (driver/recovery/selfcheck.py)."""
    node = NodeSpec("n0", interfaces=("lo",), netns=emulated_net.namespace("n0"))
    netemu.add_node(emulated_net, "n0", 0.1)  # 12.5 MB/s
    rows = {r.metric: r for r in check_loopback(node, fast_config, Faults(), 1.0)}
    assert set(rows) == {"link_bandwidth", "link_latency", "bandwidth", "latency"}  # the link and lo
    assert 0.005 < rows["link_bandwidth"].value < 0.016, rows["link_bandwidth"]
    netemu.set_link(emulated_net, "n0", up=False)
    down = [r for r in check_loopback(node, fast_config, Faults(), 1.0) if r.metric.startswith("link_")]
    assert [r.status for r in down] == ["fail", "fail"] and "is down or stalled" in down[0].detail


def test_diagnose_of_a_job_without_an_emulated_network_is_refused_in_one_line(capsys):
    if not shutil.which("ip"):
        pytest.skip("iproute2 (ip) not installed")
    assert diagnose_main(["diagnose", "--job", "no-such-job"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ConfigError: --job=no-such-job: no node of that job is on an emulated network now (cluster.network)")
