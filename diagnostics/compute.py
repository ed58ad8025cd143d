"""GEMM throughput per device. A device far below its peers fails even if its own number looks sane."""
from __future__ import annotations

import time

import torch

from .config import DiagnosticsConfig, NodeSpec
from .faults import Faults
from .report import FAIL, CheckResult


class Gemm:
    """Blocks of n x n matmuls on one device; `best` is its best GFLOP/s so far.

    `speed` < 1 is an injected fault: each block is stretched by sleeping, so the timing is real.
    """

    def __init__(self, device: torch.device, n: int, speed: float = 1.0):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.flop, self.speed, self.reps, self.best = 2.0 * n**3, speed, 1, 0.0
        while self._timed() < 0.01 and self.reps < 1 << 16:  # warm up and size blocks to >= 10 ms
            self.reps *= 2

    def _timed(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.reps):
            torch.mm(self.a, self.b)
        self.sync()
        took = time.perf_counter() - t0
        if self.speed < 1.0:
            time.sleep(took * (1.0 / self.speed - 1.0))
        return time.perf_counter() - t0

    def block(self) -> None:
        self.best = max(self.best, self.reps * self.flop / self._timed() / 1e9)


def gemm_gflops(device: torch.device, n: int, window_s: float, speed: float = 1.0) -> float:
    """Best GFLOP/s over blocks of n x n matmuls run for about `window_s`."""
    gemm, end = Gemm(device, n, speed), time.perf_counter() + window_s
    while True:
        gemm.block()
        if time.perf_counter() >= end:
            return gemm.best


def check_gemm(node: NodeSpec, config: DiagnosticsConfig, faults: Faults, budget_s: float) -> list[CheckResult]:
    on_gpu = torch.cuda.is_available()
    n = config.gemm_size or (8192 if on_gpu else 384)
    threads = torch.get_num_threads()
    # On CPU every "device" shares the host's cores; one thread each keeps devices comparable.
    if not on_gpu:
        torch.set_num_threads(1)
    rows, gemms = [], {}
    try:
        for position, dev in enumerate(node.devices):
            device = torch.device(f"cuda:{dev}" if on_gpu else "cpu")
            row = CheckResult("gemm", "flops", [node.node_id], f"{device.type}:{dev}", None, "GFLOP/s",
                              budget_s=budget_s, detail=f"n={n}", elapsed_s=0.0)
            rows.append(row)
            _on(row, lambda: gemms.__setitem__(position, Gemm(device, n, faults.gemm_factor(position))))
        # The devices take turns, a block each, rather than a window each one after the other: a host's load
        # changes within a check (ranks restarting beside a background check), and a device measured alone
        # in its busiest seconds failed against peers measured in quieter ones.
        end = time.perf_counter() + budget_s * 0.8 * len(rows)
        while gemms:
            for position in list(gemms):
                if not _on(rows[position], gemms[position].block):
                    del gemms[position]
            if time.perf_counter() >= end:
                break
        for position, gemm in gemms.items():
            rows[position].value = gemm.best
    finally:
        torch.set_num_threads(threads)
    return rows


def _on(row: CheckResult, work) -> bool:
    """Runs `work` for `row`'s device, timing it; a broken device fails its row, not the suite."""
    t0 = time.perf_counter()
    try:
        work()
        return True
    except Exception as e:  # noqa: BLE001 - a broken device is a failed check, not a crashed suite
        row.status, row.detail = FAIL, f"{row.detail}: {type(e).__name__}: {e}".splitlines()[0]
        return False
    finally:
        row.elapsed_s += time.perf_counter() - t0
