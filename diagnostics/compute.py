"""GEMM throughput per device. A device far below its peers fails even if its own number looks sane."""
from __future__ import annotations

import time

import torch

from .config import DiagnosticsConfig, NodeSpec
from .faults import Faults
from .report import FAIL, CheckResult


def gemm_gflops(device: torch.device, n: int, window_s: float, speed: float = 1.0) -> float:
    """Best GFLOP/s over blocks of n x n matmuls run for about `window_s`.

    `speed` < 1 is an injected fault: each block is stretched by sleeping, so the timing is real.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flop = 2.0 * n**3

    def block(reps: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        took = time.perf_counter() - t0
        if speed < 1.0:
            time.sleep(took * (1.0 / speed - 1.0))
        return time.perf_counter() - t0

    reps = 1
    while block(reps) < 0.01 and reps < 1 << 16:  # warm up and size blocks to >= 10 ms
        reps *= 2
    best, end = 0.0, time.perf_counter() + window_s
    while True:
        best = max(best, reps * flop / block(reps) / 1e9)
        if time.perf_counter() >= end:
            return best


def check_gemm(node: NodeSpec, config: DiagnosticsConfig, faults: Faults, budget_s: float) -> list[CheckResult]:
    on_gpu = torch.cuda.is_available()
    n = config.gemm_size or (8192 if on_gpu else 384)
    rows = []
    threads = torch.get_num_threads()
    # On CPU every "device" shares the host's cores; one thread each keeps devices comparable.
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        for position, dev in enumerate(node.devices):
            device = torch.device(f"cuda:{dev}" if on_gpu else "cpu")
            row = CheckResult("gemm", "flops", [node.node_id], f"{device.type}:{dev}", None, "GFLOP/s",
                              budget_s=budget_s, detail=f"n={n}")
            t0 = time.perf_counter()
            try:
                row.value = gemm_gflops(device, n, budget_s * 0.8, faults.gemm_factor(position))
            except Exception as e:  # noqa: BLE001 - a broken device is a failed check, not a crashed suite
                row.status, row.detail = FAIL, f"n={n}: {type(e).__name__}: {e}".splitlines()[0]
            row.elapsed_s = time.perf_counter() - t0
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows
