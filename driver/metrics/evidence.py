"""How much evidence a series of per-step log ratios holds that it runs slower than usual (for the straggler
detector, stragglers.py): its usual level, learned from its own history; windows of its newest points,
their level against that usual one, a z-score and the one-sided confidence it gives.

A rank's window is judged by its fast steps (`fast_mean`, from its 10th to its 60th percentile): on a shared
host noise only adds time (a descheduled process, a busy core), so a healthy rank's slow steps come in bursts
while a slowed rank has no fast step left. Its usual level and spread are those of the same statistic over
every earlier window of that size (learned, not assumed: the host's noise is neither normal nor independent).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

MEAN_SE = 1.15  # a small sample's 20%-trimmed mean has a standard error of ~1.15 sigma / sqrt(n)
MEDIAN_SE = 1.25  # a median's: 1.25 sigma / sqrt(n)
MAD_SIGMA = 1.4826  # MAD to the standard deviation of a normal
MIN_FAST = 8  # earlier windows of a size it takes to judge a window against them


def trimmed_mean(xs: list[float], trim: float) -> float:
    xs = sorted(xs)
    cut = int(trim * len(xs) + 0.5)
    return statistics.fmean(xs[cut:len(xs) - cut] or xs)


def fast_mean(xs: list[float], keep: tuple[float, float]) -> float:
    """The mean of `xs` from its `keep[0]` to its `keep[1]` quantile (at least one value): its fast steps,
    less the fastest few (a step its peers were the slow ones in)."""
    xs = sorted(xs)
    low = int(keep[0] * len(xs) + 0.5)
    return statistics.fmean(xs[low:max(low + 1, int(keep[1] * len(xs) + 0.5))])


def confidence(z: float) -> float:
    """The one-sided normal probability of a z-score."""
    return 0.5 * math.erfc(-z / math.sqrt(2))


@dataclass
class Point:
    step: int
    value: float
    ref: float  # the peers' median (a stage: the other stages')
    x: float  # log(value / ref)
    x_tp: Optional[float]  # log(value / its TP peers' median), for a rank that has TP peers
    total: float  # the step's median wall time
    flagged: bool = False  # a finding covered this point: kept out of the usual value
    fast: dict[int, float] = field(default_factory=dict)  # window size: fast_mean of the window ending here


@dataclass
class Window:
    """The evidence of a series' last `size` points."""
    size: int
    usual: float  # the series' usual x, learned before the window
    shift: float  # its level (trimmed mean of x, or fast_mean), less its usual level
    se: float  # the standard error of that level, from the per-step noise (fast windows: their learned spread)
    excess_s: float  # mean seconds a step above its usual
    points: list[Point]
    fast: bool = False  # judged by its fast steps against earlier windows (se: their spread)
    z: float = 0.0

    @property
    def slowdown(self) -> float:
        return math.exp(self.shift)

    def onset(self) -> int:
        """The change point: the step from which the sum of x - usual - half to the window's end is
        largest (the points from there on run above halfway to the slow level, those before it below).
        The slow level: the median of the window's slower half, or the shift if larger (a window judged
        by its fast steps shifts less than its slow steps run)."""
        xs = sorted(p.x for p in self.points)
        half = max(self.shift, statistics.median(xs[len(xs) // 2:]) - self.usual) / 2
        total, best, at = 0.0, -math.inf, self.points[-1].step
        for p in reversed(self.points):
            total += p.x - self.usual - half
            if total > best:
                best, at = total, p.step
        return at


class Series:
    """One judged series: a rank against its stage peers, or a stage against the other stages.
    `bias_cap`: the usual level counts within +-log(bias_cap) (None: as learned); with `at_par`, within
    0 .. log(bias_cap) (a series usually faster than its peers is judged against them)."""

    def __init__(self, history: int, longest: int, trim: float, bias_cap: Optional[float],
                 keep: Optional[tuple[float, float]] = None, sizes: Sequence[int] = (), at_par: bool = False):
        self.history, self.trim, self.keep, self.sizes = history, trim, keep, tuple(sizes)
        self.cap = math.log(bias_cap) if bias_cap else None
        self.at_par = at_par
        self.points: deque[Point] = deque(maxlen=history + longest)

    def add(self, point: Point) -> None:
        """Appends a point; with `keep`, the fast_mean of each window size ending at it."""
        self.points.append(point)
        if self.keep is not None:
            recent = [p.x for p in list(self.points)[-max(self.sizes, default=1):]]
            point.fast = {w: fast_mean(recent[-w:], self.keep) for w in self.sizes if len(recent) >= w}

    def _capped(self, b: float) -> float:
        return b if self.cap is None else min(self.cap, max(0.0 if self.at_par else -self.cap, b))

    def usual(self, before: int = 0) -> tuple[float, int]:
        """(usual x, points it was learned from): the median of the unflagged points before the last `before`."""
        older = list(self.points)[:len(self.points) - before]
        learned = [p.x for p in older if not p.flagged][-self.history:]
        if not learned:
            return 0.0, 0
        return self._capped(statistics.median(learned)), len(learned)

    def windows(self, sizes: Sequence[int], sigma: float, min_history: int = 0) -> dict[int, Window]:
        """The evidence of each full window with `min_history` learned points before it, by size."""
        points = list(self.points)
        out = {}
        for w in sizes:
            b, learned = self.usual(before=w)
            if len(points) < w or learned < min_history:
                break
            window = points[-w:]
            fast = [p.fast[w] for p in points[:-w] if not p.flagged and w in p.fast][-self.history:]
            if self.keep is not None and len(fast) >= MIN_FAST:
                # Against the earlier windows of this size: their median level, their spread.
                b = self._capped(statistics.median(fast))
                shift = window[-1].fast[w] - b
                se = MAD_SIGMA * statistics.median(abs(f - b) for f in fast)
            else:  # too little history: against the peers (usual x 0 until learned) and the per-step noise
                shift = trimmed_mean([p.x for p in window], self.trim) - b
                se = sigma * math.sqrt(MEAN_SE ** 2 / w + (MEDIAN_SE ** 2 / learned if learned else 0.0))
            excess = statistics.fmean(p.value - p.ref * math.exp(b) for p in window)
            out[w] = Window(w, b, shift, se, excess, window, fast=len(fast) >= MIN_FAST and self.keep is not None)
        return out

    def residuals(self, last: int) -> list[float]:
        """Its last points' x around their own median: the step-to-step noise, which a slow rank's
        shifted level leaves alone."""
        xs = [p.x for p in list(self.points)[-last:]]
        middle = statistics.median(xs) if xs else 0.0
        return [x - middle for x in xs]

    def differences(self, last: int) -> list[float]:
        """Its last points' steps from the point before, over sqrt(2): the per-step noise of each."""
        xs = [p.x for p in list(self.points)[-last:]]
        return [(b - a) / math.sqrt(2) for a, b in zip(xs, xs[1:])]


def against_each_other(evidence: Iterable[dict[int, Window]], floor: float) -> None:
    """z of each rank's window: its shift over the larger of its standard error and the spread of all
    ranks' shifts over the same steps. Host noise that moves many ranks at once (on a shared host whole
    groups of ranks run slower for a few steps) widens that spread; one slow rank barely does. `floor`: the
    per-step noise taken at least (identical peers have none)."""
    by_size: dict[int, list[Window]] = defaultdict(list)
    for windows in evidence:
        for size, win in windows.items():
            by_size[size].append(win)
    for wins in by_size.values():
        shifts = [w.shift for w in wins]
        middle = statistics.median(shifts)
        spread = MAD_SIGMA * statistics.median(abs(x - middle) for x in shifts) if len(wins) >= 4 else 0.0
        # A fast window's learned spread, pooled over the ranks: one rank's few windows say little alone.
        pooled = statistics.median(w.se for w in wins if w.fast) if any(w.fast for w in wins) else 0.0
        for w in wins:
            w.z = w.shift / max(pooled if w.fast else w.se, spread, floor / math.sqrt(w.size))


def pooled(evidence: Iterable[dict[int, Window]], floor: float) -> None:
    """z of each window: its shift over the median, across the series, of their windows' learned spread
    (one series' few earlier windows say little alone), or over its own standard error before that is
    learned. For series that mirror each other (two DP replicas, each against the other), so cannot be
    compared with each other's shifts."""
    by_size: dict[int, list[Window]] = defaultdict(list)
    for windows in evidence:
        for size, win in windows.items():
            by_size[size].append(win)
    for wins in by_size.values():
        learned = [w.se for w in wins if w.fast]
        spread = statistics.median(learned) if learned else 0.0
        for w in wins:
            w.z = w.shift / max(spread if w.fast else w.se, floor / math.sqrt(w.size))


def on_its_own(evidence: Iterable[dict[int, Window]]) -> None:
    """z of each window against its standard error alone (stages: too few to compare with each other)."""
    for windows in evidence:
        for win in windows.values():
            win.z = win.shift / win.se


def noise(series: Iterable[Series], floor: float, last: int = 16, mirrored: bool = False) -> float:
    """The per-step noise of x: robust, pooled over the series; inf while too little is seen. `mirrored`:
    series that all move when one shifts (DP replicas, each against the others): from the differences of
    successive points, which a shift moves once."""
    pooled = [abs(r) for s in series for r in (s.differences(last) if mirrored else s.residuals(last))]
    if len(pooled) < 8:
        return math.inf
    return max(floor, MAD_SIGMA * statistics.median(pooled))
