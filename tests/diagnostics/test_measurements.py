"""Each measurement runs for real on CPU, and an injected fault really slows what it measures."""
import pytest
import torch
from megascale.diagnostics import NodeSpec
from megascale.diagnostics import compute
from megascale.diagnostics.compute import gemm_gflops
from megascale.diagnostics.faults import Faults, RateLimitedProxy
from megascale.diagnostics.health import check_health, memory_test
from megascale.diagnostics.loopback import Sink, tcp_loopback


def test_rate_limited_proxy_throttles_tcp_loopback():
    with Sink("127.0.0.1", timeout_s=5) as sink:
        fast, fast_lat = tcp_loopback(sink.address, 0.4, 64 << 20, 5)
        with RateLimitedProxy(sink.address, rate=10e6) as proxy:
            slow, _ = tcp_loopback(proxy.address, 0.4, 64 << 20, 5)
    assert 0 < fast_lat < 1000
    assert slow == pytest.approx(0.010, rel=0.3)  # GB/s: the proxy's 10 MB/s
    assert fast > 10 * slow


def test_slowed_gemm_measures_slower():
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    normal = max(gemm_gflops(cpu, 256, 0.1) for _ in range(2))  # best of 2: the test host is shared
    slowed = gemm_gflops(cpu, 256, 0.15, speed=0.1)
    assert normal > 0 and slowed / normal < 0.35


def test_health_rows_and_configured_thresholds(fast_config):
    assert memory_test(torch.device("cpu"), 1 << 20) == 1.0
    rows = {r.metric: r for r in check_health(NodeSpec("n0"), fast_config, 2.0)}
    assert rows["device_memory"].value == 1.0 and rows["host_memory"].value > 0
    assert rows["checkpoint_disk"].value > 0 and rows["shm"].value >= 0
    # No GPU here: ECC / XID are skipped with the reason, never silently passed.
    assert rows["ecc_uncorrected"].status == "skip" and "nvidia-smi" in rows["ecc_uncorrected"].detail


def test_gemm_devices_take_turns_so_a_host_that_gets_busy_mid_check_fails_none(fast_config, monkeypatch):
    """Four CPU 'devices' share the host: its matmuls run at full speed for the check's first half, at a third
    for the rest (ranks restarting beside a background check). Measured one after the other, the last devices
    read a third of the first and failed against them; in turns, each sees both halves."""
    clock = [0.0]
    monkeypatch.setattr(compute.time, "perf_counter", lambda: clock[0])

    def matmul(a, b):
        clock[0] += 0.01 if clock[0] < 1.0 else 0.03

    monkeypatch.setattr(compute.torch, "mm", matmul)
    rows = compute.check_gemm(NodeSpec("n0", devices=(0, 1, 2, 3)), fast_config, Faults(), budget_s=1.0)
    assert [r.value for r in rows] == [pytest.approx(rows[0].value)] * 4 and rows[0].value > 0
    assert all(r.elapsed_s > 0.5 for r in rows)  # each had a share of the whole check, not a window of its own
