"""Straggler detection: which rank is persistently slower than the peers doing the same work.

Every rank of a pipeline stage does the same work (TP shards and DP replicas are equal), so at
each step each rank's segment time is compared with the other ranks of its stage by robust
statistics, the peers' median and MAD. A rank is slow at a step when

    value >= min_ratio * median  and  value - median >= min_excess_s  and
    (value - median) / max(1.4826 * MAD, mad_floor * median) >= min_z

and it is reported only when slow in at least `k` of its last `n` steps (one noisy step, a
GC pause or a descheduled thread, is not a straggler). The whole stage, not only the TP or DP
group, is the reference because a group of two gives a median of one noisy peer.

Where it shows (the finding's `dimension`):
  tp  slower than its own TP peers too: one device (GPU, its PCIe link) on that node;
  dp  level with its TP peers, all slower than the stage's other DP replicas: the TP group,
      typically one node, is slow;
  pp  level with its whole stage, and the stage slower than the others in its PP group. Stages
      differ in work (embedding, loss head), so this needs the looser `pp_min_ratio`.

Segments: `compute` is the step minus the time spent waiting on peers
(total - exposed_tp - exposed_pp - exposed_dp). The timers nest TP waits inside forward and
backward and DP waits inside optimizer, so a straggler's peers inflate those segments as much
as the straggler does; `compute` is the one figure waiting does not inflate. `data` (the
batch load) contains no communication and is compared as it is.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

from megascale.common.messages import Event

DIMENSIONS = ("tp", "dp", "pp")  # narrowest first
DEFAULT_SEGMENTS = ("compute", "data")
_EXACT_PEERS = 16  # larger sets use the median including the rank itself (cheaper, the same answer)


@dataclass(frozen=True)
class Thresholds:
    min_ratio: float = 1.2  # slower than 1.2x the peers' median
    pp_min_ratio: float = 1.5  # across pipeline stages, whose work differs
    min_excess_s: float = 0.005  # and by at least 5 ms a step: timer noise on tiny segments is not a straggler
    min_z: float = 3.5  # and well outside the peers' spread
    mad_floor: float = 0.05  # the spread is at least 5% of the median (identical peers have MAD 0)
    k: int = 3  # slow in at least k ...
    n: int = 5  # ... of the rank's last n steps


@dataclass
class Finding:
    rank: int
    node: int  # rank // ranks_per_node
    node_name: str
    segment: str
    dimension: str  # where it shows: tp (a device), dp (its TP group, a node), pp (its stage)
    slowdown: float  # median over the slow steps of value / peers' median (its stage; its PP group for pp)
    excess_s: float  # median seconds a step above the peers' median
    steps_observed: int  # slow steps among the last `steps_window`
    steps_window: int
    first_step: int  # first and last slow step in the window
    last_step: int
    tp: int
    pp: int
    dp: int
    dimensions: list[str] = field(default_factory=list)  # every dimension it was slow in at k or more steps
    peer_wait_s: dict = field(default_factory=dict)  # how much longer its peers waited on it (exposed_<dim>)

    def to_dict(self) -> dict:
        return asdict(self)


def segment_value(rec: dict, segment: str) -> float:
    seg = rec["segments"]
    if segment == "compute":
        waited = seg.get("exposed_tp", 0.0) + seg.get("exposed_pp", 0.0) + seg.get("exposed_dp", 0.0)
        return max(0.0, rec["total"] - waited)
    return float(seg.get(segment, 0.0))


def _by_step(records: Iterable[dict]) -> dict[int, dict[int, dict]]:
    steps: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        steps[r["step"]][r["rank"]] = r  # a replayed (rank, step) keeps its last record
    return steps


def _spread(values: list[float], th: "Thresholds") -> tuple[float, float]:
    """(median, robust spread) of a set of peers' values."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median, max(1.4826 * mad, th.mad_floor * median, 1e-9)


class _Peers:
    """The reference a group gives each member: its peers' median and spread (leave-one-out in small
    groups; in large ones the group's own, computed once, which a single member barely moves)."""

    def __init__(self, members: list[dict], value: dict[int, float], th: "Thresholds"):
        self.values = [value[m["rank"]] for m in members]
        self.index = {m["rank"]: i for i, m in enumerate(members)}
        self.th = th
        self.whole = _spread(self.values, th) if len(members) > _EXACT_PEERS else None

    def of(self, rank: int) -> Optional[tuple[float, float]]:
        if len(self.values) < 2:
            return None
        if self.whole is not None:
            return self.whole
        i = self.index[rank]
        return _spread(self.values[:i] + self.values[i + 1:], self.th)


def _is_slow(value: float, ref: Optional[tuple[float, float]], need: float, th: "Thresholds") -> bool:
    if ref is None:
        return False
    median, spread = ref
    return value - median >= th.min_excess_s and value >= need * median and (value - median) / spread >= th.min_z


def _groups(ranks: dict[int, dict], value: dict[int, float], th: "Thresholds", *fixed: str) -> dict[tuple, _Peers]:
    members: dict[tuple, list[dict]] = defaultdict(list)
    for r in ranks.values():
        members[tuple(r[c] for c in fixed)].append(r)
    return {key: _Peers(group, value, th) for key, group in members.items()}


def _compare(ranks: dict[int, dict], segment: str, th: "Thresholds"):
    """Per rank at one step: (rank, ratio to its stage peers, dimension if slow else None, ratio, excess)."""
    value = {rank: segment_value(r, segment) for rank, r in ranks.items()}
    stages, tp_groups = _groups(ranks, value, th, "pp"), _groups(ranks, value, th, "dp", "pp")
    dp_groups, pp_groups = _groups(ranks, value, th, "tp", "pp"), _groups(ranks, value, th, "tp", "dp")
    for rank, r in ranks.items():
        v = value[rank]
        stage = stages[(r["pp"],)].of(rank)
        stage_ratio = v / stage[0] if stage and stage[0] > 0 else 1.0
        if _is_slow(v, stage, th.min_ratio, th):
            own_tp_slow = _is_slow(v, tp_groups[(r["dp"], r["pp"])].of(rank), th.min_ratio, th)
            no_dp_peers = len(dp_groups[(r["tp"], r["pp"])].values) < 2
            yield rank, stage_ratio, "tp" if own_tp_slow or no_dp_peers else "dp", stage_ratio, v - stage[0]
            continue
        pp = pp_groups[(r["tp"], r["dp"])].of(rank)
        if _is_slow(v, pp, th.pp_min_ratio, th):
            yield rank, stage_ratio, "pp", v / pp[0], v - pp[0]
            continue
        yield rank, stage_ratio, None, 0.0, 0.0


def _peer_wait(ranks: dict[int, dict], rank: int) -> dict[str, float]:
    """Per dimension: the peers' median exposed wait minus the rank's own (how long they waited on it)."""
    fixed = {"tp": ("dp", "pp"), "dp": ("tp", "pp"), "pp": ("tp", "dp")}
    me = ranks[rank]
    out = {}
    for dim in DIMENSIONS:
        peers = [r for r in ranks.values() if r["rank"] != rank and all(r[c] == me[c] for c in fixed[dim])]
        if peers:
            key = f"exposed_{dim}"
            out[dim] = statistics.median(p["segments"].get(key, 0.0) for p in peers) - me["segments"].get(key, 0.0)
    return out


def detect(records: Iterable[dict], ranks_per_node: int, *, segments: Sequence[str] = DEFAULT_SEGMENTS,
           thresholds: Thresholds = Thresholds(), node_names: Optional[Sequence[str]] = None) -> list[Finding]:
    """Stragglers in a window of StepTimings dicts (any order; only the window's last `n` steps count)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, not {ranks_per_node}")
    th, names = thresholds, list(node_names or ())
    by_step = _by_step(records)
    window = sorted(by_step)[-th.n:]
    # (rank, segment) -> step -> (dimension, ratio, excess) for the steps it was slow
    slow: dict[tuple[int, str], dict[int, tuple[str, float, float]]] = defaultdict(dict)
    for step in window:
        for segment in segments:
            for rank, _, dim, ratio, excess in _compare(by_step[step], segment, th):
                if dim is not None:
                    slow[(rank, segment)][step] = (dim, ratio, excess)
    present = defaultdict(int)
    for step in window:
        for rank in by_step[step]:
            present[rank] += 1
    findings = []
    for (rank, segment), steps in slow.items():
        if len(steps) < th.k:
            continue
        counts = {d: sum(dim == d for dim, _, _ in steps.values()) for d in DIMENSIONS}
        persistent = [d for d in DIMENSIONS if counts[d] >= th.k]
        dimension = persistent[0] if persistent else max(DIMENSIONS, key=lambda d: counts[d])
        ratios = [(ratio, excess) for _, ratio, excess in steps.values()]
        waits = [_peer_wait(by_step[s], rank) for s in steps]
        rec = by_step[max(steps)][rank]
        node = rank // ranks_per_node
        findings.append(Finding(
            rank=rank, node=node, node_name=names[node] if node < len(names) else f"node{node}",
            segment=segment, dimension=dimension, slowdown=round(statistics.median(r for r, _ in ratios), 3),
            excess_s=round(statistics.median(e for _, e in ratios), 6), steps_observed=len(steps),
            steps_window=present[rank], first_step=min(steps), last_step=max(steps),
            tp=rec["tp"], pp=rec["pp"], dp=rec["dp"], dimensions=persistent or [dimension],
            peer_wait_s={d: round(statistics.median(w[d] for w in waits if d in w), 6)
                         for d in DIMENSIONS if any(d in w for w in waits)}))
    return sorted(findings, key=lambda f: (-f.slowdown, f.rank, f.segment))


def slowness(records: Iterable[dict], segment: str = "compute",
             thresholds: Thresholds = Thresholds()) -> dict[int, float]:
    """Each rank's median (over its last `n` steps) of its value over its stage peers' median: 1.0 is normal."""
    by_step = _by_step(records)
    ratios: dict[int, list[float]] = defaultdict(list)
    for step in sorted(by_step)[-thresholds.n:]:
        for rank, stage_ratio, _, _, _ in _compare(by_step[step], segment, thresholds):
            ratios[rank].append(stage_ratio)
    return {rank: round(statistics.median(v), 3) for rank, v in sorted(ratios.items())}


def describe(f: Finding) -> str:
    """One line for `megascale status` and the events topic."""
    return (f"straggler: rank {f.rank} on {f.node_name} (tp{f.tp} pp{f.pp} dp{f.dp}): {f.segment} "
            f"{f.slowdown:.2f}x its {f.dimension} peers (+{f.excess_s * 1e3:.1f} ms/step) "
            f"in {f.steps_observed} of its last {f.steps_window} steps")


def to_event(job: str, f: Finding, cleared: bool = False) -> Event:
    message = f"straggler cleared: rank {f.rank} on {f.node_name}" if cleared else describe(f)
    return Event(job=job, type="node", message=message, node=f.node_name,
                 detail={"straggler": f.to_dict(), "cleared": cleared})


class StragglerMonitor:
    """Keeps the last `n` steps of records and reports findings that appear or clear between updates."""

    def __init__(self, ranks_per_node: int, *, segments: Sequence[str] = DEFAULT_SEGMENTS,
                 thresholds: Thresholds = Thresholds(), node_names: Optional[Sequence[str]] = None):
        self.ranks_per_node, self.segments, self.thresholds = ranks_per_node, segments, thresholds
        self.node_names = node_names
        self._steps: dict[int, dict[int, dict]] = {}
        self.current: dict[tuple[int, str], Finding] = {}

    def add(self, records: Iterable[dict]) -> None:
        for r in records:
            self._steps.setdefault(r["step"], {})[r["rank"]] = r
        # Keep one step more than the window: the newest step may still be missing some ranks.
        for step in sorted(self._steps)[:-(self.thresholds.n + 1)]:
            del self._steps[step]

    def window(self) -> list[dict]:
        """The records findings are computed over: the last `n` steps, less an incomplete newest one."""
        steps = dict(self._steps)
        newest = max(steps, default=None)
        if newest is not None and len(steps) > self.thresholds.n and len(steps[newest]) < max(map(len, steps.values())):
            del steps[newest]  # an incomplete newest step would compare a partial group
        return [r for ranks in steps.values() for r in ranks.values()]

    def findings(self) -> list[Finding]:
        return detect(self.window(), self.ranks_per_node, segments=self.segments, thresholds=self.thresholds,
                      node_names=self.node_names)

    def update(self, records: Iterable[dict] = ()) -> tuple[list[Finding], list[Finding]]:
        """(new findings, cleared findings) since the previous update."""
        self.add(records)
        now = {(f.rank, f.segment): f for f in self.findings()}
        new = [f for key, f in now.items() if key not in self.current]
        cleared = [f for key, f in self.current.items() if key not in now]
        self.current = now
        return new, cleared
