"""Always-on per-rank, per-step segment timers: the one source for overlap measurements,
straggler detection and dashboards.

Segments: `data`, `forward`, `backward`, `optimizer`; for each communication kind
(`tp`, `pp`, `dp`) the wall time during which at least one operation of that kind was
in flight, from issue until it was waited on (`comm_<kind>`; for a receive posted
ahead this includes the sender's compute), and the part compute had to wait for it
(`exposed_<kind>`, the number that overlap must drive down). Wall clock on CPU. On GPU the same
calls record CUDA events that are resolved after the step, so the critical path is
never synchronised.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import torch

COMM_KINDS = ("tp", "pp", "dp")
SEGMENTS = ("data", "forward", "backward", "optimizer") + tuple(
    f"{prefix}_{kind}" for prefix in ("comm", "exposed") for kind in COMM_KINDS)


@dataclass
class StepTimings:
    """What one rank spent one step on (seconds); crosses process boundaries as JSON."""

    step: int
    rank: int
    tp: int
    pp: int
    dp: int
    start: float  # unix time the step began
    total: float
    segments: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _CudaSpan:
    """A pair of CUDA events read only after the step (no synchronisation on the critical path)."""

    def __init__(self) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def seconds(self) -> float:
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000.0


class StepTimer:
    def __init__(self, device: Optional[torch.device] = None, enabled: bool = True):
        self.cuda = device is not None and device.type == "cuda"
        self.enabled = enabled
        self._totals: dict[str, float] = defaultdict(float)
        self._cuda_spans: list[tuple[str, _CudaSpan]] = []
        self._in_flight: dict[str, tuple[int, float]] = {}  # kind -> (open operations, since)

    @contextmanager
    def span(self, segment: str) -> Iterator[None]:
        """Time a block of compute or a blocking wait, attributed to `segment`."""
        if not self.enabled:
            yield
            return
        if self.cuda:
            events = _CudaSpan()
            events.begin.record()
            yield
            events.end.record()
            self._cuda_spans.append((segment, events))
            return
        started = time.perf_counter()
        yield
        self._totals[segment] += time.perf_counter() - started

    def add(self, segment: str, seconds: float) -> None:
        if self.enabled:
            self._totals[segment] += seconds

    def issued(self, kind: str) -> None:
        count, since = self._in_flight.get(kind, (0, time.perf_counter()))
        self._in_flight[kind] = (count + 1, since)

    def completed(self, kind: str) -> None:
        """Closes one in-flight operation; the busy interval ends when none is left open."""
        count, since = self._in_flight[kind]
        if count == 1:
            del self._in_flight[kind]
            self.add(f"comm_{kind}", time.perf_counter() - since)
        else:
            self._in_flight[kind] = (count - 1, since)

    def collect(self) -> dict[str, float]:
        """Segment totals since the last collect (resolves CUDA events here, after the step)."""
        for segment, events in self._cuda_spans:
            self._totals[segment] += events.seconds()
        self._cuda_spans.clear()
        totals = {name: round(self._totals.get(name, 0.0), 6) for name in SEGMENTS}
        self._totals.clear()
        return totals
