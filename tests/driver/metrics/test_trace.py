"""The Chrome trace-event JSON has the structure Perfetto and chrome://tracing read."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
from megascale.driver.metrics.trace import layout_step, parse_steps, to_chrome_trace


def test_trace_of_a_real_run_is_well_formed_and_nested(real_run, facts):
    trace = json.loads(json.dumps(to_chrome_trace(real_run, facts.RANKS_PER_NODE, job="demo")))
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["traceEvents"], list)
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str)
        assert type(e["pid"]) is int and type(e["tid"]) is int
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert isinstance(e["args"], dict)
            assert e["pid"] == e["tid"] // facts.RANKS_PER_NODE  # pid = node, tid = rank
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {(r // 2, r): names[(r // 2, r)] for r in range(4)} and names[(1, 3)] == "rank 3 (tp1 pp0 dp1)"
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"} == {0: "node 0", 1: "node 1"}

    by_thread: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[e["tid"]].append(e)
    for spans in by_thread.values():
        steps = sorted((e for e in spans if e["cat"] == "step"), key=lambda e: e["ts"])
        assert len(steps) == facts.STEPS
        for a, b in zip(steps, steps[1:]):  # steps on one thread never overlap
            assert a["ts"] + a["dur"] <= b["ts"]
        for step in steps:
            children = sorted((e for e in spans if e["cat"] == "segment" and e["args"]["step"] == step["args"]["step"]),
                              key=lambda e: e["ts"])
            assert [c["name"] for c in children][:3] == ["data", "forward", "backward"]
            for c in children:  # nested inside their step: Perfetto draws them as its slices
                assert step["ts"] <= c["ts"] and c["ts"] + c["dur"] <= step["ts"] + step["dur"]
            for a, b in zip(children, children[1:]):
                assert a["ts"] + a["dur"] <= b["ts"]


def test_layout_never_overflows_the_step():
    rec = {"total": 1.0, "segments": {"data": 0.2, "forward": 0.5, "backward": 0.6, "optimizer": 0.1}}
    spans = layout_step(rec)
    assert spans[-1][1] + spans[-1][2] == pytest.approx(1.0)
    rec = {"total": 2.0, "segments": {"data": 0.0, "forward": 0.5, "backward": 1.0, "optimizer": 0.1}}
    assert [name for name, _, _ in layout_step(rec)] == ["forward", "backward", "optimizer", "other"]


def test_step_ranges():
    assert parse_steps("3:7") == (3, 7) and parse_steps("5") == (5, 5) and parse_steps(":9") == (None, 9)
    assert parse_steps("-10", (1, 100)) == (91, 100)
    with pytest.raises(ValueError, match="expected A:B"):
        parse_steps("a:b")
