"""Straggler detection: which rank, TP group or pipeline stage is persistently slower than it should be.

Every figure is compared only with work of the same kind:

  a TP group  (stages with several DP replicas) with the stage's other TP groups, which do equal work: at
           each step y = log(its forward + backward time / the other groups' median of it). Its members
           wait for each other inside forward and backward, so that time is the group's pace, set by its
           slowest member; dividing by the other replicas at the same step cancels what slows the whole
           job at once (a busy host). Its usual y, learned from its own recent history, counts within
           0 .. +10% (`bias_cap`): a group usually a little slower keeps that, one usually faster is judged
           against its peers (back at their pace it slows nothing). Who holds a slow group back: the member
           whose compute runs above its TP peers' by at least half the group's slowdown (they wait for it);
           none stands out, the whole group.
  a rank   (a stage that is one TP group, and the `data` segment) with the other ranks of its stage: at
           each step x = log(value / the stage peers' median), against its usual x (within +-10%).
  a stage  with its own recent history, never with another stage's time (stages differ in work:
           embedding, loss head, uneven layers): at each step y = log(stage median / the other stages'
           median), against its usual y, its share of the work.

A group or rank is judged over windows of its last 4, 6, 8 and 10 judged steps by its fast steps (the
window's 10th to 60th percentile: host noise comes in bursts, a slowed one has no fast step left),
against the same statistic over its earlier windows (evidence.py); a stage over 8, 16 and 32, by the
window's trimmed mean against its usual value. The excess is its slowdown; over its standard error (the spread of
the earlier windows, pooled over the groups; or the noise measured on this job now, or for ranks the spread
of all ranks' windows over the same steps if larger) a z-score, whose one-sided normal probability is the
finding's `confidence`. A finding needs z >= `report_z` in a window that also shows that window's slowdown
(`windows`: the shorter the evidence, the bigger the slowdown it must show; on a host whose noise slows a
healthy group by 1.2-1.3x for a few steps now and then, 6 steps must show 1.6x, 8 steps 1.25x) and an excess of at least
`min_excess_s` and `min_share` of the step; it stays while some window keeps z >= `keep_z` (no flicker at
the threshold). The first `warmup_steps` steps of each incarnation (allocator and cache warm-up, a restore)
are not judged, and a stage only once `min_history` steps have taught it its usual share.
docs/observability.md has the measured precision and recall.

Where it shows (`dimension`):
  tp  one rank holding its TP group back (or slower than its stage peers, in a stage without DP
      replicas): one device (a GPU, its link) on that node;
  dp  a whole TP group (with tp 1: the rank) slower than the stage's other DP replicas, no member
      standing out: its node;
  pp  a whole stage slower than its own usual pace against the other stages: the nodes of that stage.

Segments: `compute` is the step minus the time spent waiting on peers (total - exposed_tp -
exposed_pp - exposed_dp); a straggler's peers wait for it, so waiting-inclusive figures would inflate
theirs too, except within its TP group, which is judged as one. `data` (the batch load) holds no
communication and is compared as it is.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

from .evidence import (Point, Series, Window, against_each_other, confidence, noise, on_its_own, pooled,
                       trimmed_mean)

DIMENSIONS = ("tp", "dp", "pp")  # narrowest first
DEFAULT_SEGMENTS = ("compute", "data")
_EXACT_PEERS = 16  # larger groups use the median including the rank itself (cheaper, the same answer)
_TRAIL = 16  # confidences a finding keeps (control.straggler_evict_after is at most this)
_STALE_STEPS = 32  # a step this far behind the newest is judged with the ranks it has (a node went quiet)
# findings a monitor remembers: an incarnation can last weeks, and a rank that keeps slowing and recovering
# adds one (a few KB of evidence) each time; the driver reads only the standing ones
REPORTED_KEEP = 1000


@dataclass(frozen=True)
class Thresholds:
    min_excess_s: float = 0.005  # by at least 5 ms a step: timer noise on tiny segments is not a straggler
    min_share: float = 0.05  # and by at least 5% of the step: a 6 ms stall in a 1 s step costs nothing
    report_z: float = 4.0  # evidence to report (confidence 0.99997)
    keep_z: float = 2.0  # a reported finding clears below this
    # (judged steps, the slowdown it takes over that many): the shorter the evidence, the bigger the
    # slowdown it must show, so a burst of host noise on one rank for a few steps is not a straggler.
    # Up to 10 steps: a finding within 10 steps of the onset is the goal (megascale bench stragglers).
    windows: tuple[tuple[int, float], ...] = ((4, 3.0), (6, 1.6), (8, 1.25), (10, 1.2))
    pp_windows: tuple[tuple[int, float], ...] = ((8, 1.6), (16, 1.4), (32, 1.3))  # a stage's, against its usual pace
    warmup_steps: int = 5  # of each incarnation, not judged
    history: int = 32  # judged steps a usual value is learned from
    min_history: int = 16  # learned steps before a stage is judged against its usual share
    bias_cap: float = 1.1  # a rank's usual ratio to its stage peers counts within 1/1.1 .. 1.1
    noise_floor: float = 0.02  # per-step noise is taken as at least 2% (identical peers have none)
    trim: float = 0.2  # of each end of a window, dropped before the mean: one hiccup is not evidence
    keep: tuple[float, float] = (0.1, 0.6)  # a rank's window is judged from its 10th to 60th percentile step
    # (evidence.py: host noise only adds time; the fastest steps are those its peers were slow in)
    group_keep: tuple[float, float] = (0.1, 0.6)  # a TP group's window, judged by its fast steps as a rank's


@dataclass
class Finding:
    rank: int  # the rank; for a stage (pp), its first rank
    node: int  # rank // ranks_per_node
    node_name: str
    segment: str
    dimension: str  # where it shows: tp (a device), dp (its TP group), pp (its stage)
    slowdown: float  # over what is usual for it (its stage peers; for pp its own pace against the other stages)
    excess_s: float  # seconds a step above that, over the evidence window
    confidence: float  # one-sided normal probability of the evidence's z-score
    window: list[int]  # [first, last] step of the evidence
    values: list[float]  # its value at each step of the window (a stage: its ranks' median)
    peers_median: list[float]  # its stage peers' median at each step (a stage: the other stages')
    usual: float  # its usual ratio to that median, learned after warm-up (1.0 until learned)
    noise: float  # the per-step spread of log(value / peers_median) on this job now
    since: int  # the step it was first reported
    onset: int  # where the slowness began, as its first evidence shows it (a change point in that window)
    last_step: int  # the newest step judged
    tp: int
    pp: int
    dp: int
    ranks: list[int] = field(default_factory=list)  # the ranks it covers: one, or a stage's
    trail: list[float] = field(default_factory=list)  # its confidence at each of its last _TRAIL judged steps
    nodes: list[int] = field(default_factory=list)  # their nodes: an eviction needs exactly one
    cleared_at: Optional[int] = None  # the step its evidence fell below keep_z

    @property
    def steps_reported(self) -> int:
        """Judged steps it has been reported for, this one included."""
        return self.last_step - self.since + 1

    def to_dict(self) -> dict:
        return {**asdict(self), "steps_reported": self.steps_reported}


def segment_value(rec: dict, segment: str) -> float:
    seg = rec["segments"]
    if segment == "compute":
        waited = seg.get("exposed_tp", 0.0) + seg.get("exposed_pp", 0.0) + seg.get("exposed_dp", 0.0)
        return max(0.0, rec["total"] - waited)
    return float(seg.get(segment, 0.0))


def _median_without(values: list[float], i: int) -> Optional[float]:
    """The median of `values` less the i-th (in large groups, of all: one member barely moves it)."""
    if len(values) < 2:
        return None
    if len(values) > _EXACT_PEERS:
        return statistics.median(values)
    return statistics.median(values[:i] + values[i + 1:])


def group_pace(ranks: dict[int, dict]) -> dict[tuple[int, int], tuple[float, float, list[int]]]:
    """Per TP group (pp, dp) of a stage with other TP groups, at one step: (its forward + backward time, the
    stage's other TP groups' median of it, its ranks). A TP group's members wait for each other inside
    forward and backward, so that time is the group's pace, set by its slowest member."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, r in sorted(ranks.items()):
        groups[(r["pp"], r["dp"])].append(rank)
    pace = {key: statistics.median(_work(ranks[k]) for k in members) for key, members in groups.items()}
    out = {}
    for (pp, dp), members in groups.items():
        others = [v for (p, d), v in pace.items() if p == pp and d != dp]
        if others:
            out[(pp, dp)] = (pace[(pp, dp)], statistics.median(others), members)
    return out


def _work(rec: dict) -> float:
    """Forward + backward seconds (TP waits included), or the compute segment where those are not timed."""
    seg = rec["segments"]
    work = seg.get("forward", 0.0) + seg.get("backward", 0.0)
    return work if work > 0 else segment_value(rec, "compute")


def peer_ratios(ranks: dict[int, dict], segment: str) -> dict[int, tuple[float, float, Optional[float]]]:
    """Per rank at one step: (value, its stage peers' median, its TP peers' median or None)."""
    value = {rank: segment_value(r, segment) for rank, r in ranks.items()}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank, r in sorted(ranks.items()):
        groups[("pp", r["pp"])].append(rank)
        groups[("tp", r["pp"], r["dp"])].append(rank)
    out = {}
    for rank, r in ranks.items():
        stage, tp = groups[("pp", r["pp"])], groups[("tp", r["pp"], r["dp"])]
        ref = _median_without([value[k] for k in stage], stage.index(rank))
        if ref is not None:
            out[rank] = (value[rank], ref, _median_without([value[k] for k in tp], tp.index(rank)))
    return out


class StragglerMonitor:
    """Judges each step once it is complete, in order; keeps current findings and the newest `keep_reported`
    reported so far.

    Feed it one incarnation's records (a restart starts a new monitor): `update(records)` returns the
    findings that appeared and cleared since the previous call."""

    def __init__(self, ranks_per_node: int, *, segments: Sequence[str] = DEFAULT_SEGMENTS,
                 thresholds: Thresholds = Thresholds(), node_names: Optional[Sequence[str]] = None,
                 world_size: Optional[int] = None, keep_reported: int = REPORTED_KEEP):
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, not {ranks_per_node}")
        self.ranks_per_node, self.segments, self.thresholds = ranks_per_node, segments, thresholds
        self.node_names = node_names
        self.world_size = world_size  # ranks a complete step has; None: the most seen in one step
        self._pending: dict[int, dict[int, dict]] = {}
        self._recent: deque[dict[int, dict]] = deque(maxlen=thresholds.windows[0][0])
        self._first: Optional[int] = None  # the incarnation's first step
        self._judged = 0  # the newest step judged
        self._series: dict[tuple, Series] = {}
        self.current: dict[tuple, Finding] = {}
        self.reported: deque[Finding] = deque(maxlen=keep_reported)  # cleared ones with cleared_at

    # -- input -----------------------------------------------------------------------------

    def add(self, records: Iterable[dict]) -> None:
        for r in records:
            if r["step"] > self._judged:  # a record of a step already judged came too late to count
                self._pending.setdefault(r["step"], {})[r["rank"]] = r
                self._first = r["step"] if self._first is None else min(self._first, r["step"])

    def flush(self) -> None:
        """Judges every pending step (the end of a replay: no more records are coming)."""
        for step in sorted(self._pending):
            self._judge_step(step, self._pending.pop(step))

    def update(self, records: Iterable[dict] = ()) -> tuple[list[Finding], list[Finding]]:
        """(new findings, cleared findings) since the previous update."""
        before = dict(self.current)
        self.add(records)
        self._judge_complete()
        new = [f for key, f in self.current.items() if key not in before]
        cleared = [f for key, f in before.items() if key not in self.current]
        return new, cleared

    def findings(self) -> list[Finding]:
        return sorted(self.current.values(), key=lambda f: (-f.confidence, -f.slowdown, f.rank, f.segment))

    def window(self) -> list[dict]:
        """The newest judged steps' records (for `slowness`)."""
        return [r for ranks in self._recent for r in ranks.values()]

    def _judge_complete(self) -> None:
        """Judges pending steps in order while the oldest is complete, or stale (its missing ranks' node
        went quiet: the rest of the job is judged without it)."""
        while self._pending:
            step = min(self._pending)
            complete = len(self._pending[step]) >= (self.world_size or max(map(len, self._pending.values())))
            if not complete and max(self._pending) - step < _STALE_STEPS:
                break
            self._judge_step(step, self._pending.pop(step))

    # -- judging ---------------------------------------------------------------------------

    def _judge_step(self, step: int, ranks: dict[int, dict]) -> None:
        self._judged = step
        self._recent.append(ranks)
        if self._first is None or step < self._first + self.thresholds.warmup_steps:
            return
        total = statistics.median(r["total"] for r in ranks.values())
        th = self.thresholds
        for segment in self.segments:
            self._add_points(step, ranks, segment, total)
            fresh = {key: s for key, s in self._series.items()
                     if key[0] == segment and s.points and s.points[-1].step == step}
            for kind, sizes in (("rank", th.windows), ("group", th.windows), ("stage", th.pp_windows)):
                chosen = {key: s for key, s in fresh.items() if key[1] == kind}
                sigma = noise(chosen.values(), th.noise_floor, mirrored=kind == "group")
                evidence = {key: s.windows([w for w, _ in sizes], sigma, th.min_history if kind == "stage" else 0)
                            for key, s in chosen.items()}
                if kind == "rank":
                    against_each_other(evidence.values(), th.noise_floor)
                elif kind == "group":
                    pooled(evidence.values(), th.noise_floor)
                else:
                    on_its_own(evidence.values())
                for key, series in chosen.items():
                    self._decide(key, series, evidence[key], sigma, ranks)

    def _add_points(self, step: int, ranks: dict[int, dict], segment: str, total: float) -> None:
        th = self.thresholds
        longest = max(w for w, _ in th.windows + th.pp_windows)
        for rank, (value, ref, tp_ref) in peer_ratios(ranks, segment).items():
            if value > 0 and ref > 0:
                x_tp = math.log(value / tp_ref) if tp_ref else None
                series = self._series.setdefault((segment, "rank", rank), Series(
                    th.history, longest, th.trim, th.bias_cap, th.keep, [w for w, _ in th.windows]))
                series.add(Point(step, value, ref, math.log(value / ref), x_tp, total))
        if segment == "compute":
            for unit, (value, ref, _) in group_pace(ranks).items():
                if value > 0 and ref > 0:
                    series = self._series.setdefault((segment, "group", unit), Series(
                        th.history, longest, th.trim, th.bias_cap, th.group_keep, [w for w, _ in th.windows],
                        at_par=True))
                    series.add(Point(step, value, ref, math.log(value / ref), None, total))
        stages: dict[int, list[float]] = defaultdict(list)
        for r in ranks.values():
            stages[r["pp"]].append(segment_value(r, segment))
        medians = {p: statistics.median(v) for p, v in stages.items()}
        for p, value in medians.items():
            others = [m for q, m in medians.items() if q != p]
            ref = statistics.median(others) if others else 0.0
            if value > 0 and ref > 0:
                series = self._series.setdefault((segment, "stage", p), Series(th.history, longest, th.trim, None))
                series.add(Point(step, value, ref, math.log(value / ref), None, total))

    def _decide(self, key: tuple, series: Series, windows: dict[int, Window], sigma: float,
                ranks: dict[int, dict]) -> None:
        th = self.thresholds
        segment, kind, unit = key
        need = dict(th.pp_windows if kind == "stage" else th.windows)
        ranked = sorted(windows.values(), key=lambda w: -w.z)
        big = [w for w in ranked if w.slowdown >= need[w.size] and w.excess_s >= th.min_excess_s
               and w.excess_s >= th.min_share * statistics.median(p.total for p in w.points)]
        sure = [w for w in big if w.z >= th.report_z]
        found = self.current.get(key)
        if sure and found is None and self._standing_elsewhere(key, ranks):
            pass  # the same straggler, already reported as its TP group's or as the rank itself
        elif sure:  # its evidence: the sure window that shows the most slowdown
            self._record(key, series, max(sure, key=lambda w: w.slowdown), sigma, ranks, found)
        elif found is not None and ranked and ranked[0].z >= th.keep_z and ranked[0].shift > 0:
            # Fading, not gone: it keeps the evidence it was last reported on, with today's confidence.
            found.last_step, found.confidence = series.points[-1].step, round(confidence(ranked[0].z), 6)
            found.trail = (found.trail + [found.confidence])[-_TRAIL:]
        elif found is not None:
            found.cleared_at = series.points[-1].step
            del self.current[key]
        if key in self.current:
            series.points[-1].flagged = True

    def _standing_elsewhere(self, key: tuple, ranks: dict[int, dict]) -> bool:
        """A rank of a TP group that stands reported, or a TP group with a member that does."""
        segment, kind, unit = key
        if kind == "rank":
            return (segment, "group", (ranks[unit]["pp"], ranks[unit]["dp"])) in self.current
        if kind == "group":
            return any((segment, "rank", rank) in self.current
                       for rank, r in ranks.items() if (r["pp"], r["dp"]) == unit)
        return False

    def _record(self, key: tuple, series: Series, j: Window, sigma: float, ranks: dict[int, dict],
                found: Optional[Finding]) -> None:
        segment, kind, unit = key
        if kind == "stage":
            covered = sorted(rank for rank, r in ranks.items() if r["pp"] == unit)
            dimension = "pp"
        elif kind == "group":
            covered, dimension = self._slow_members(segment, unit, ranks, j)
        else:
            covered, dimension = [unit], self._rank_dimension(unit, ranks, j)
        first = ranks[covered[0]]
        node = covered[0] // self.ranks_per_node
        names = list(self.node_names or ())
        step = series.points[-1].step
        finding = Finding(
            rank=covered[0], node=node, node_name=names[node] if node < len(names) else f"node{node}",
            segment=segment, dimension=dimension, slowdown=round(j.slowdown, 3), excess_s=round(j.excess_s, 6),
            confidence=round(confidence(j.z), 6), window=[j.points[0].step, j.points[-1].step],
            values=[round(p.value, 6) for p in j.points], peers_median=[round(p.ref, 6) for p in j.points],
            usual=round(math.exp(j.usual), 3), noise=round(sigma, 4),
            since=step, onset=j.onset(), last_step=step, tp=first["tp"], pp=first["pp"], dp=first["dp"],
            ranks=covered, nodes=sorted({r // self.ranks_per_node for r in covered}))
        if found is None:
            self.reported.append(finding)
            self.current[key] = finding
        else:  # the same finding, with the newest evidence
            vars(found).update({**vars(finding), "since": found.since, "onset": found.onset, "trail": found.trail})
            finding = found
        finding.trail = (finding.trail + [finding.confidence])[-_TRAIL:]

    def _slow_members(self, segment: str, unit: tuple[int, int], ranks: dict[int, dict], j: Window
                      ) -> tuple[list[int], str]:
        """Which of a slow TP group's ranks hold it back: the one computing the most against its TP peers
        over the window (the others wait for it), when it stands out from the rest by at least half the
        group's slowdown (tp: a device); otherwise the whole group (dp: its node; tp 1: the rank is its
        TP group)."""
        members = sorted(rank for rank, r in ranks.items() if (r["pp"], r["dp"]) == unit)
        if len(members) == 1:
            return members, "dp"
        steps = {p.step for p in j.points}
        against_tp = {}
        for rank in members:
            series = self._series.get((segment, "rank", rank))
            xs = [p.x_tp for p in series.points if p.step in steps and p.x_tp is not None] if series else []
            against_tp[rank] = trimmed_mean(xs, self.thresholds.trim) if xs else 0.0
        slowest = max(members, key=lambda rank: against_tp[rank])
        rest = statistics.median(against_tp[rank] for rank in members if rank != slowest)
        if against_tp[slowest] - rest >= math.log(j.slowdown) / 2:
            return [slowest], "tp"
        return members, "dp"

    def _rank_dimension(self, rank: int, ranks: dict[int, dict], j: Window) -> str:
        """tp when at least half its slowdown shows against its own TP peers too (or its stage is one TP
        group); dp when it is level with them (its whole TP group is slow)."""
        me = ranks[rank]
        stage = [r for r in ranks.values() if r["pp"] == me["pp"]]
        tp_group = [r for r in stage if r["dp"] == me["dp"]]
        if len(tp_group) == len(stage):
            return "tp"
        against_tp = [p.x_tp for p in j.points if p.x_tp is not None]
        if not against_tp:
            return "dp"
        return "tp" if trimmed_mean(against_tp, self.thresholds.trim) >= math.log(j.slowdown) / 2 else "dp"


def replay(records: Iterable[dict], ranks_per_node: int, *, segments: Sequence[str] = DEFAULT_SEGMENTS,
           thresholds: Thresholds = Thresholds(), node_names: Optional[Sequence[str]] = None
           ) -> list[StragglerMonitor]:
    """Stored records (any order) judged as the driver judges them live: one monitor per incarnation,
    oldest first (records without an incarnation are one)."""
    by_incarnation: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_incarnation[r.get("incarnation") or 0].append(r)
    monitors = []
    for incarnation in sorted(by_incarnation):
        monitor = StragglerMonitor(ranks_per_node, segments=segments, thresholds=thresholds, node_names=node_names)
        monitor.add(sorted(by_incarnation[incarnation], key=lambda r: r["step"]))
        monitor.flush()
        monitors.append(monitor)
    return monitors


def detect(records: Iterable[dict], ranks_per_node: int, *, segments: Sequence[str] = DEFAULT_SEGMENTS,
           thresholds: Thresholds = Thresholds(), node_names: Optional[Sequence[str]] = None) -> list[Finding]:
    """The findings standing at the end of stored records (those of their newest incarnation)."""
    monitors = replay(records, ranks_per_node, segments=segments, thresholds=thresholds, node_names=node_names)
    return monitors[-1].findings() if monitors else []


def slowness(records: Iterable[dict], segment: str = "compute",
             thresholds: Thresholds = Thresholds()) -> dict[int, float]:
    """Each rank's median, over its newest few steps, of its value over its stage peers' median: 1.0 is normal."""
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        by_step[r["step"]][r["rank"]] = r
    ratios: dict[int, list[float]] = defaultdict(list)
    for step in sorted(by_step)[-thresholds.windows[0][0]:]:
        for rank, (value, ref, _) in peer_ratios(by_step[step], segment).items():
            ratios[rank].append(value / ref if ref > 0 else 1.0)
    return {rank: round(statistics.median(v), 3) for rank, v in sorted(ratios.items())}
