"""Step timings as a Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): pid = node, tid = rank.

Timers keep per-step segment totals, not individual spans, so each step is drawn as its
segments laid end to end in execution order (data, forward, backward, the pipeline wait,
optimizer, then whatever the timers did not cover). Communication in flight and the TP/DP
waits nested inside forward/backward/optimizer are in each step's `args`.
"""
from __future__ import annotations

from typing import Iterable, Optional

# Drawn in this order; `exposed_pp` is waited outside the compute spans (receives between them).
LANE = (("data", "data"), ("forward", "forward"), ("backward", "backward"), ("exposed_pp", "wait pp"),
        ("optimizer", "optimizer"))


def layout_step(rec: dict) -> list[tuple[str, float, float]]:
    """(name, offset_s, duration_s) of a step's segments laid end to end within its total."""
    total = max(0.0, float(rec["total"]))
    parts = [(label, max(0.0, float(rec["segments"].get(key, 0.0)))) for key, label in LANE]
    covered = sum(d for _, d in parts)
    scale = total / covered if covered > total > 0 else 1.0  # timer rounding must not overflow the step
    spans, at = [], 0.0
    for label, duration in parts:
        duration *= scale
        if duration > 0:
            spans.append((label, at, duration))
            at += duration
    if total - at > 1e-6:
        spans.append(("other", at, total - at))
    return spans


def _meta(event: str, pid: int, tid: int, **args: object) -> dict:
    return {"name": event, "ph": "M", "pid": pid, "tid": tid, "args": args}


def to_chrome_trace(records: Iterable[dict], ranks_per_node: int, job: str = "") -> dict:
    records = sorted(records, key=lambda r: (r["rank"], r["start"]))
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, not {ranks_per_node}")
    origin = min((r["start"] for r in records), default=0.0)
    events: list[dict] = []
    named_nodes: set[int] = set()
    named_ranks: set[int] = set()
    prev_end: dict[int, int] = {}
    for r in records:
        rank, node = r["rank"], r["rank"] // ranks_per_node
        if node not in named_nodes:
            named_nodes.add(node)
            events.append(_meta("process_name", node, 0, name=f"node {node}"))
            events.append(_meta("process_sort_index", node, 0, sort_index=node))
        if rank not in named_ranks:
            named_ranks.add(rank)
            label = f"rank {rank} (tp{r['tp']} pp{r['pp']} dp{r['dp']})"
            events.append(_meta("thread_name", node, rank, name=label))
            events.append(_meta("thread_sort_index", node, rank, sort_index=rank))
        # Whole microseconds: exact integers keep every segment inside its step and steps apart.
        ts, dur = round((r["start"] - origin) * 1e6), round(r["total"] * 1e6)
        # Step starts come from the wall clock and totals from a monotonic one: never let steps overlap.
        if ts < prev_end.get(rank, ts):
            dur, ts = max(0, dur - (prev_end[rank] - ts)), prev_end[rank]
        prev_end[rank] = ts + dur
        events.append({"name": f"step {r['step']}", "cat": "step", "ph": "X", "ts": ts, "dur": dur, "pid": node,
                       "tid": rank, "args": {"step": r["step"], "total_s": r["total"], **r["segments"]}})
        scale = dur / (r["total"] * 1e6) if r["total"] > 0 else 0.0
        for name, offset, length in layout_step(r):
            # Both ends from the running offset, so one segment ends exactly where the next begins.
            begin = min(ts + round(offset * 1e6 * scale), ts + dur)
            end = min(ts + round((offset + length) * 1e6 * scale), ts + dur)
            if end > begin:
                events.append({"name": name, "cat": "segment", "ph": "X", "ts": begin, "dur": end - begin,
                               "pid": node, "tid": rank, "args": {"step": r["step"]}})
    steps = [r["step"] for r in records]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job": job, "origin_unix_s": origin, "ranks_per_node": ranks_per_node,
                          "steps": [min(steps), max(steps)] if steps else [],
                          "layout": "segment totals laid end to end within each step"}}


def parse_steps(text: str, step_range: Optional[tuple[int, int]] = None) -> tuple[Optional[int], Optional[int]]:
    """'A:B' (inclusive), 'A:', ':B', 'A' or '-N' (the last N steps of `step_range`)."""
    text = text.strip()
    try:
        if text.startswith("-") and ":" not in text:
            if step_range is None:
                return None, None
            return max(step_range[0], step_range[1] - int(text[1:]) + 1), step_range[1]
        if ":" in text:
            a, b = text.split(":", 1)
            first, last = (int(a) if a else None), (int(b) if b else None)
        else:
            first = last = int(text)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B, A:, :B, A or -N (e.g. 100:200)") from None
    if first is not None and last is not None and first > last:
        raise ValueError(f"--steps {text!r}: the first step is after the last")
    return first, last
