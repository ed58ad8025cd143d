"""The JSON the dashboard page renders: heatmap, 3D-parallel grid, step timeline, stragglers, status.

The straggler findings are the detector's own (driver/metrics/stragglers.py), replayed over the shown
steps and up to HISTORY_STEPS before them, where it learns the job's pace as it did live; findings
that cleared are kept, marked, so the heatmap can show what the detector saw and when.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Optional

from ..metrics.schema import segment_names
from ..metrics.sources import TimingsSource
from ..metrics.stragglers import Thresholds, peer_ratios, replay, segment_value, slowness
from ..metrics.trace import layout_step

MAX_COLS = 200  # steps beyond this are averaged into buckets
MAX_ROWS = 1024  # ranks beyond this are shown one row per node
HISTORY_STEPS = 64  # read before the shown steps for the detector (its longest window and what it learns from)
SLOWDOWN = "slowdown"  # colour mode: compute over the stage peers' median, the detector's own ratio
SLOWDOWN_SCALE = (0.5, 2.0)  # its colour range: twice as fast to twice as slow, 1.0 in the middle


def value_of(rec: dict, value: str) -> float:
    return float(rec["total"]) if value == "total" else segment_value(rec, value)


def findings(records: list[dict], ranks_per_node: int, thresholds: Thresholds) -> list[dict]:
    """Every finding the detector reports over `records` (oldest incarnation first); `active`: still standing
    at their end (only the newest incarnation's can be: a restart ends the others)."""
    monitors = replay(records, ranks_per_node, thresholds=thresholds)
    out = []
    for i, monitor in enumerate(monitors):
        standing = {id(f) for f in monitor.current.values()} if i == len(monitors) - 1 else set()
        out += [{**f.to_dict(), "active": id(f) in standing} for f in monitor.reported]
    return out


def _values(records: list[dict], value: str) -> list[tuple[dict, float]]:
    if value != SLOWDOWN:
        return [(r, value_of(r, value)) for r in records]
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        by_step[r["step"]][r["rank"]] = r
    out = []
    for ranks in by_step.values():
        for rank, (v, ref, _) in peer_ratios(ranks, "compute").items():
            out.append((ranks[rank], v / ref if ref > 0 else 1.0))
    return out


def build(source: TimingsSource, ranks_per_node: int, status: Optional[dict] = None, *, value: str = "total",
          window: int = 200, first: Optional[int] = None, last: Optional[int] = None, step: Optional[int] = None,
          thresholds: Thresholds = Thresholds()) -> dict:
    status = source.status() if status is None else status
    available = source.step_range()
    if available is None:
        return {"job": source.job, "status": status, "empty": True, "ranks_per_node": ranks_per_node,
                "range": None, "value": value, "values": ["total", "compute"]}
    if last is None:
        last = available[1]
    if first is None:
        first = max(available[0], last - window + 1)
    judged = source.read(max(available[0], first - HISTORY_STEPS), last)
    records = [r for r in judged if r["step"] >= first]
    ranks = sorted({r["rank"] for r in records})
    layout = {d: 1 + max((r[d] for r in records), default=0) for d in ("tp", "pp", "dp")}
    values = ["total", "compute", SLOWDOWN] + segment_names(records)
    if value not in values:
        raise ValueError(f"unknown value {value!r}; one of {', '.join(values)}")
    reported = [f for f in findings(judged, ranks_per_node, thresholds)
                if f["active"] or f["cleared_at"] is None or f["cleared_at"] > first]
    active = [f for f in reported if f["active"]]
    slow = {rank for f in active for rank in f["ranks"]}
    scores = slowness(records, thresholds=thresholds)
    return {
        "job": source.job, "status": status, "empty": False, "ranks_per_node": ranks_per_node,
        "range": list(available), "shown": [first, last], "value": value, "values": values, "layout": layout,
        "heatmap": _heatmap(records, ranks, ranks_per_node, value),
        "grid": [{"rank": r["rank"], "tp": r["tp"], "pp": r["pp"], "dp": r["dp"], "node": r["rank"] // ranks_per_node,
                  "score": scores.get(r["rank"], 1.0), "straggler": r["rank"] in slow}
                 for r in _newest_per_rank(records)],
        "findings": active,  # standing now
        "reported": reported,  # every finding over the shown steps, the cleared ones too
        "timeline": _timeline(records, ranks_per_node, step),
    }


def _newest_per_rank(records: list[dict]) -> list[dict]:
    newest: dict[int, dict] = {}
    for r in records:
        if r["step"] >= newest.get(r["rank"], {"step": -1})["step"]:
            newest[r["rank"]] = r
    return [newest[k] for k in sorted(newest)]


def _heatmap(records: list[dict], ranks: list[int], ranks_per_node: int, value: str) -> dict:
    steps = sorted({r["step"] for r in records})
    per_col = max(1, -(-len(steps) // MAX_COLS))
    cols = [steps[i:i + per_col] for i in range(0, len(steps), per_col)]
    col_of = {s: i for i, col in enumerate(cols) for s in col}
    by_node = len(ranks) > MAX_ROWS
    keys = sorted({r // ranks_per_node for r in ranks}) if by_node else ranks
    row_of = {k: i for i, k in enumerate(keys)}
    sums = [[0.0] * len(cols) for _ in keys]
    counts = [[0] * len(cols) for _ in keys]
    for r, v in _values(records, value):
        i, j = row_of[r["rank"] // ranks_per_node if by_node else r["rank"]], col_of[r["step"]]
        sums[i][j] += v
        counts[i][j] += 1
    cells = [[round(s / c, 6) if c else None for s, c in zip(srow, crow)] for srow, crow in zip(sums, counts)]
    present = sorted(v for row in cells for v in row if v is not None)
    median = statistics.median(present) if present else 0.0
    if value == SLOWDOWN:  # a ratio: one fixed scale around 1.0, comparable from run to run
        low, high = SLOWDOWN_SCALE
    else:  # 2nd to 98th percentile, at most 3x the median: a warm-up step does not wash out the rest
        low = present[int(0.02 * (len(present) - 1))] if present else 0.0
        high = min(present[int(0.98 * (len(present) - 1))], 3 * median) if present else 1.0
    return {
        "by": "node" if by_node else "rank",
        "scale": "ratio" if value == SLOWDOWN else "seconds",
        "rows": [{"key": k, "node": k if by_node else k // ranks_per_node, "values": row}
                 for k, row in zip(keys, cells)],
        "cols": [[c[0], c[-1]] for c in cols],
        "min": low, "max": high, "median": median,  # cells beyond the range show its end colour
    }


def _timeline(records: list[dict], ranks_per_node: int, step: Optional[int]) -> dict:
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    if not by_step:
        return {"step": None, "rows": []}
    if step not in by_step:  # the newest step every rank has reported, else the newest
        most = max(len(v) for v in by_step.values())
        step = max(s for s, v in by_step.items() if len(v) == most)
    rows = by_step[step]
    origin = min(r["start"] for r in rows)
    return {"step": step, "rows": [
        {"rank": r["rank"], "node": r["rank"] // ranks_per_node, "offset": round(r["start"] - origin, 6),
         "total": r["total"],
         "spans": [{"name": n, "start": round(s, 6), "dur": round(d, 6)} for n, s, d in layout_step(r)]}
        for r in sorted(rows, key=lambda r: r["rank"])]}
