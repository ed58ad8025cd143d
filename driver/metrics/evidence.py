"""How much evidence a series of per-step log ratios holds that it runs slower than usual (for the straggler
detector, stragglers.py): its usual level, learned from its own history; windows of its newest points,
their trimmed mean against that level, a z-score and the one-sided confidence it gives.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

MEAN_SE = 1.15  # a small sample's 20%-trimmed mean has a standard error of ~1.15 sigma / sqrt(n)
MEDIAN_SE = 1.25  # a median's: 1.25 sigma / sqrt(n)
MAD_SIGMA = 1.4826  # MAD to the standard deviation of a normal


def trimmed_mean(xs: list[float], trim: float) -> float:
    xs = sorted(xs)
    cut = int(trim * len(xs) + 0.5)
    return statistics.fmean(xs[cut:len(xs) - cut] or xs)


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


@dataclass
class Window:
    """The evidence of a series' last `size` points."""
    size: int
    usual: float  # the series' usual x, learned before the window
    shift: float  # trimmed mean of x, less its usual x
    se: float  # the standard error of that mean, from the per-step noise
    excess_s: float  # mean seconds a step above its usual
    points: list[Point]
    z: float = 0.0

    @property
    def slowdown(self) -> float:
        return math.exp(self.shift)

    def onset(self) -> int:
        """The change point: the step from which the sum of x - usual - shift / 2 to the window's end is
        largest (the points from there on run above halfway to the shift, those before it below)."""
        total, best, at = 0.0, -math.inf, self.points[-1].step
        for p in reversed(self.points):
            total += p.x - self.usual - self.shift / 2
            if total > best:
                best, at = total, p.step
        return at


class Series:
    """One judged series: a rank against its stage peers, or a stage against the other stages.
    `bias_cap`: the usual level counts within +-log(bias_cap) (None: as learned)."""

    def __init__(self, history: int, longest: int, trim: float, bias_cap: Optional[float]):
        self.history, self.trim = history, trim
        self.cap = math.log(bias_cap) if bias_cap else None
        self.points: deque[Point] = deque(maxlen=history + longest)

    def usual(self, before: int = 0) -> tuple[float, int]:
        """(usual x, points it was learned from): the median of the unflagged points before the last `before`."""
        older = list(self.points)[:len(self.points) - before]
        learned = [p.x for p in older if not p.flagged][-self.history:]
        if not learned:
            return 0.0, 0
        b = statistics.median(learned)
        return (b if self.cap is None else min(self.cap, max(-self.cap, b))), len(learned)

    def windows(self, sizes: Sequence[int], sigma: float, min_history: int = 0) -> dict[int, Window]:
        """The evidence of each full window with `min_history` learned points before it, by size."""
        points = list(self.points)
        out = {}
        for w in sizes:
            b, learned = self.usual(before=w)
            if len(points) < w or learned < min_history:
                break
            window = points[-w:]
            shift = trimmed_mean([p.x for p in window], self.trim) - b
            se = sigma * math.sqrt(MEAN_SE ** 2 / w + (MEDIAN_SE ** 2 / learned if learned else 0.0))
            excess = statistics.fmean(p.value - p.ref * math.exp(b) for p in window)
            out[w] = Window(w, b, shift, se, excess, window)
        return out

    def residuals(self, last: int) -> list[float]:
        """Its last points' x around their own median: the step-to-step noise, which a slow rank's
        shifted level leaves alone."""
        xs = [p.x for p in list(self.points)[-last:]]
        middle = statistics.median(xs) if xs else 0.0
        return [x - middle for x in xs]


def against_each_other(evidence: Iterable[dict[int, Window]]) -> None:
    """z of each rank's window: its shift over the larger of its standard error and the spread of all
    ranks' shifts over the same steps. Host noise that moves many ranks at once (on a shared host whole
    groups of ranks run slower for a few steps) widens that spread; one slow rank barely does."""
    by_size: dict[int, list[Window]] = defaultdict(list)
    for windows in evidence:
        for size, win in windows.items():
            by_size[size].append(win)
    for wins in by_size.values():
        shifts = [w.shift for w in wins]
        middle = statistics.median(shifts)
        spread = MAD_SIGMA * statistics.median(abs(x - middle) for x in shifts) if len(wins) >= 4 else 0.0
        for w in wins:
            w.z = w.shift / max(w.se, spread)


def on_its_own(evidence: Iterable[dict[int, Window]]) -> None:
    """z of each window against its standard error alone (stages: too few to compare with each other)."""
    for windows in evidence:
        for win in windows.values():
            win.z = win.shift / win.se


def noise(series: Iterable[Series], floor: float, last: int = 16) -> float:
    """The per-step noise of x: robust, pooled over the series; inf while too little is seen."""
    pooled = [abs(r) for s in series for r in s.residuals(last)]
    if len(pooled) < 8:
        return math.inf
    return max(floor, MAD_SIGMA * statistics.median(pooled))
