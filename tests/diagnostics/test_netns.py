"""A real throttled NIC path: a network namespace whose loopback has a token-bucket qdisc (tc tbf).

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
