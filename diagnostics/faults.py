"""Fault injection for tests: each fault makes a real measurement slower, it never fakes a number.

Faults are NodeSpec.faults entries named like environment variables and are honoured only when
`DiagnosticsConfig.allow_fault_injection` is set (or MEGASCALE_DIAG_ALLOW_FAULTS=1 for the CLI):

  MEGASCALE_DIAG_SLOW_GEMM=0.3       every device of the node runs GEMM at 0.3x speed (sleeps stretch it)
  MEGASCALE_DIAG_SLOW_GEMM=1:0.3     only device index 1 (position in NodeSpec.devices)
  MEGASCALE_DIAG_SLOW_RANK=1:30      local rank 1 sleeps 30 ms before each intra-node collective
  MEGASCALE_DIAG_SLOW_NET=30         the node's rank sleeps 30 ms before each inter-node collective
  MEGASCALE_DIAG_HANG_RANK=1         local rank 1 stops responding inside the collective checks
  MEGASCALE_DIAG_LOOPBACK_RATE_MB=20 loopback traffic goes through a 20 MB/s rate-limited TCP proxy
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from megascale.config import ConfigError

ALLOW_ENV = "MEGASCALE_DIAG_ALLOW_FAULTS"
PREFIX = "MEGASCALE_DIAG_"


@dataclass(frozen=True)
class Faults:
    slow_gemm: dict = field(default_factory=dict)  # device position (or None = all) -> speed factor
    slow_rank: dict = field(default_factory=dict)  # local rank -> delay seconds per collective
    slow_net_s: float = 0.0
    hang_rank: int | None = None
    loopback_rate: float | None = None  # bytes/s

    def gemm_factor(self, position: int) -> float:
        return self.slow_gemm.get(position, self.slow_gemm.get(None, 1.0))


NO_FAULTS = Faults()


def faults_allowed(flag: bool) -> bool:
    return flag or os.environ.get(ALLOW_ENV) == "1"


def parse_faults(node_id: str, spec: Mapping[str, str], allowed: bool) -> Faults:
    if not spec:
        return NO_FAULTS
    where = f"nodes[{node_id}].faults"
    if not allowed:
        raise ConfigError(f"{where}: fault injection needs allow_fault_injection=true or {ALLOW_ENV}=1")
    out: dict = {"slow_gemm": {}, "slow_rank": {}}
    for key, raw in spec.items():
        name, value = f"{where}.{key}", str(raw).strip()
        if key == PREFIX + "SLOW_GEMM":
            position, factor = _split(name, value, optional_index=True)
            if not 0 < factor <= 1:
                raise ConfigError(f"{name}={value!r}: speed factor must be in (0, 1]")
            out["slow_gemm"][position] = factor
        elif key == PREFIX + "SLOW_RANK":
            rank, delay_ms = _split(name, value, optional_index=False)
            if delay_ms < 0:
                raise ConfigError(f"{name}={value!r}: delay must be >= 0 ms")
            out["slow_rank"][rank] = delay_ms / 1000
        elif key == PREFIX + "SLOW_NET":
            out["slow_net_s"] = _nonneg(name, value) / 1000
        elif key == PREFIX + "HANG_RANK":
            out["hang_rank"] = int(_nonneg(name, value))
        elif key == PREFIX + "LOOPBACK_RATE_MB":
            rate = _nonneg(name, value)
            if rate <= 0:
                raise ConfigError(f"{name}={value!r} must be > 0 MB/s")
            out["loopback_rate"] = rate * 1e6
        else:
            raise ConfigError(f"{name}: unknown fault; see megascale.diagnostics.faults")
    return Faults(**out)


def _split(name: str, value: str, optional_index: bool) -> tuple[int | None, float]:
    index, sep, number = value.rpartition(":")
    if not sep and not optional_index:
        raise ConfigError(f"{name}={value!r}: expected RANK:MILLISECONDS")
    try:
        return (int(index) if sep else None), float(number)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected [INDEX:]NUMBER") from None


def _nonneg(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be a number") from None
    if number < 0:
        raise ConfigError(f"{name}={value!r} must be >= 0")
    return number


class RateLimitedProxy:
    """A TCP proxy on 127.0.0.1 that forwards to `target` at no more than `rate` bytes/s per direction.

    Small socket buffers keep the bytes "in flight" few, so a sender sees the limit promptly.
    """

    def __init__(self, target: tuple[str, int], rate: float, buffer_bytes: int = 64 * 1024) -> None:
        self.target, self.rate, self.buffer = target, float(rate), buffer_bytes
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.address: tuple[str, int] = self._listener.getsockname()
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="diag-proxy").start()

    def __enter__(self) -> RateLimitedProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer)
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        # Send in slices of ~10 ms worth of bytes and sleep until the schedule allows the next one.
        chunk = max(1024, min(self.buffer, int(self.rate / 100)))
        sent, start = 0, time.monotonic()
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
                sent += len(data)
                ahead = sent / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        except OSError:
            return
