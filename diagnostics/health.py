"""Node health: device memory, ECC and XID errors (via nvidia-smi / the kernel log), host memory, free disk."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import torch

from .config import DiagnosticsConfig, NodeSpec
from .report import FAIL, SKIP, CheckResult

_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def check_health(node: NodeSpec, config: DiagnosticsConfig, budget_s: float) -> list[CheckResult]:
    deadline = time.monotonic() + budget_s
    rows = _device_memory(node, config, budget_s)
    rows.append(_measured(node, "host_memory", "host", psutil.virtual_memory().available / 1e9, "GB"))
    rows.append(_disk(node, "checkpoint_disk", config.checkpoint_dir))
    rows.append(_disk(node, "shm", config.shm_path))
    rows += _gpu_errors(node, max(1.0, deadline - time.monotonic()))
    for row in rows:
        row.budget_s = budget_s
    return rows


def memory_test(device: torch.device, nbytes: int) -> float:
    """Allocate `nbytes`, write two patterns and read them back; return the fraction verified."""
    n = max(1, nbytes // 4)
    x = torch.empty(n, dtype=torch.int32, device=device)
    torch.arange(n, dtype=torch.int32, device=device, out=x)
    expect = n * (n - 1) // 2
    ok = int(x.sum(dtype=torch.int64)) == expect
    x.bitwise_not_()  # ~i == -i - 1, so the sum flips to -expect - n
    ok = ok and int(x.sum(dtype=torch.int64)) == -expect - n
    del x
    return 1.0 if ok else 0.0


def _device_memory(node: NodeSpec, config: DiagnosticsConfig, budget_s: float) -> list[CheckResult]:
    nbytes = int(config.alloc_mb * 2**20)
    targets = [f"cuda:{d}" for d in node.devices] if torch.cuda.is_available() else ["cpu"]
    rows = []
    for target in targets:
        row = CheckResult("health", "device_memory", [node.node_id], target, None, "fraction",
                          detail=f"{config.alloc_mb:g} MB written and read back")
        t0 = time.perf_counter()
        try:
            row.value = memory_test(torch.device(target), nbytes)
        except Exception as e:  # noqa: BLE001 - out of memory or a device error is this check failing
            row.status, row.detail = FAIL, f"{config.alloc_mb:g} MB: {type(e).__name__}: {e}".splitlines()[0]
        row.elapsed_s = time.perf_counter() - t0
        rows.append(row)
    return rows


def _measured(node: NodeSpec, metric: str, target: str, value: float, unit: str, detail: str = "") -> CheckResult:
    return CheckResult("health", metric, [node.node_id], target, round(value, 3), unit, detail=detail)


def _disk(node: NodeSpec, metric: str, path: str) -> CheckResult:
    # A checkpoint dir that does not exist yet lands on its nearest existing parent's filesystem.
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return _measured(node, metric, str(path), shutil.disk_usage(p).free / 1e9, "GB", detail=f"filesystem of {p}")
    except OSError as e:
        return CheckResult("health", metric, [node.node_id], str(path), None, "GB", status=FAIL, detail=str(e))


def _gpu_errors(node: NodeSpec, timeout_s: float) -> list[CheckResult]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [CheckResult("health", m, [node.node_id], "gpu", None, "count", status=SKIP,
                            detail="nvidia-smi not found")
                for m in ("ecc_uncorrected", "xid")]
    rows = []
    try:
        out = subprocess.run([smi, "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [CheckResult("health", "ecc_uncorrected", [node.node_id], "gpu", None, "count", status=FAIL,
                            detail=f"nvidia-smi failed: {e}".splitlines()[0])]
    gpus = parse_smi(out)
    xids = _kernel_xids(timeout_s)
    for dev in node.devices:
        bus, ecc = gpus.get(dev, (None, None))
        if bus is None:
            rows.append(CheckResult("health", "ecc_uncorrected", [node.node_id], f"cuda:{dev}", None, "count",
                                    status=FAIL, detail="not listed by nvidia-smi"))
            continue
        if ecc is None:
            rows.append(CheckResult("health", "ecc_uncorrected", [node.node_id], f"cuda:{dev}", None, "count",
                                    status=SKIP, detail="ECC not reported (disabled or unsupported)"))
        else:
            rows.append(_measured(node, "ecc_uncorrected", f"cuda:{dev}", ecc, "count"))
        if xids is None:
            rows.append(CheckResult("health", "xid", [node.node_id], f"cuda:{dev}", None, "count",
                                    status=SKIP, detail="kernel log not readable"))
        else:
            codes = [code for pci, code in xids if _same_bus(pci, bus)]
            rows.append(_measured(node, "xid", f"cuda:{dev}", len(codes), "count",
                                  detail=f"Xid codes {sorted(set(codes))}" if codes else ""))
    return rows


def parse_smi(text: str) -> dict[int, tuple[str, int | None]]:
    """`index, pci.bus_id, ecc` CSV lines -> {index: (bus_id, uncorrected count or None)}."""
    gpus = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        gpus[int(parts[0])] = (parts[1], int(parts[2]) if parts[2].isdigit() else None)
    return gpus


def parse_xids(text: str) -> list[tuple[str, int]]:
    return [(m.group(1), int(m.group(2))) for m in _XID.finditer(text)]


def _kernel_xids(timeout_s: float) -> list[tuple[str, int]] | None:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_xids(out)


def _same_bus(xid_pci: str, smi_bus: str) -> bool:
    # Xid prints "0000:3b:00", nvidia-smi "00000000:3B:00.0": compare bus and device numbers.
    def tail(s: str) -> str:
        return ":".join(s.lower().split(".")[0].split(":")[-2:])

    return tail(xid_pci) == tail(smi_bus)
