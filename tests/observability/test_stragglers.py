"""Straggler detection on a real multi-rank run, and on records derived from its timings."""
from __future__ import annotations

import copy
import random

import pytest
from megascale.driver.metrics.stragglers import (
    StragglerMonitor,
    describe,
    detect,
    slowness,
    to_event,
)

from megascale.common.messages import Event, decode, encode

RANKS_PER_NODE = 2  # as in conftest.real_run


def upto(records: list[dict], last: int) -> list[dict]:
    return [r for r in records if r["step"] <= last]


def test_a_slowed_rank_of_a_real_run_is_named_within_a_few_steps_and_no_other_rank_ever_is(real_run, facts):
    SLOW_RANK, ONSET, STEPS = facts.SLOW_RANK, facts.ONSET, facts.STEPS
    th = facts.THRESHOLDS
    first_seen = None
    for last in range(th.n, STEPS + 1):
        findings = detect(upto(real_run, last), RANKS_PER_NODE, thresholds=th)
        assert {f.rank for f in findings} <= {SLOW_RANK}, [describe(f) for f in findings]
        if last < ONSET:
            assert findings == [], f"false positive on the even steps up to {last}: {[describe(f) for f in findings]}"
        elif findings and first_seen is None:
            first_seen = last
    # k slow steps after the onset are enough; a noisy step on the host may cost one or two more.
    assert first_seen is not None and first_seen <= ONSET + th.n - 1, f"detected at step {first_seen}, onset {ONSET}"

    (found,) = [f for f in detect(real_run, RANKS_PER_NODE, thresholds=th) if f.segment == "compute"]
    assert (found.rank, found.node, found.node_name) == (SLOW_RANK, 1, "node1")
    assert (found.tp, found.pp, found.dp) == (1, 0, 1)
    assert found.dimension == "tp"  # one rank slower than its TP peer on the same node: a device, not the node
    assert found.dimensions == ["tp"]
    assert found.steps_observed >= th.k and found.first_step >= ONSET
    assert found.excess_s == pytest.approx(facts.DELAY_S * facts.MICROBATCHES, rel=0.5)
    assert found.slowdown > 1.3
    assert max(found.peer_wait_s.values()) > 0  # its peers wait for it
    scores = slowness(real_run, thresholds=th)
    assert scores[SLOW_RANK] == max(scores.values())


def _slow_down(rec: dict, seconds: float) -> dict:
    """The rank computes `seconds` longer; the step (lockstep) stays as long as the slowest rank's."""
    out = copy.deepcopy(rec)
    out["segments"]["forward"] += seconds
    out["total"] += seconds
    return out


def _waits(rec: dict, kind: str, seconds: float) -> dict:
    out = copy.deepcopy(rec)
    out["segments"][f"exposed_{kind}"] += seconds
    out["segments"][f"comm_{kind}"] += seconds
    out["total"] += seconds
    return out


def test_a_whole_slow_node_shows_against_its_dp_peers_only(real_run, facts):
    """Derived from the real run's even steps: ranks 2 and 3 (node 1, one TP group) both 300 ms slower
    (several times the host's step-to-step noise)."""
    even = [r for r in real_run if r["step"] < facts.ONSET]
    derived = [_slow_down(r, 0.3) if r["rank"] in (2, 3) else _waits(r, "dp", 0.3) for r in even]
    findings = detect(derived, RANKS_PER_NODE, thresholds=facts.THRESHOLDS)
    compute = {f.rank: f for f in findings if f.segment == "compute"}
    assert set(compute) == {2, 3}
    assert all(f.dimension == "dp" and "tp" not in f.dimensions and f.node == 1 for f in compute.values())


def _levelled(records: list[dict]) -> list[dict]:
    """Every rank given rank 0's timings of the same step: real step timings without rank-to-rank noise."""
    first = {r["step"]: r for r in records if r["rank"] == 0}
    return [{**copy.deepcopy(first[r["step"]]), **{k: r[k] for k in ("rank", "tp", "pp", "dp")}} for r in records]


def test_one_slow_step_is_not_a_straggler_but_k_of_n_are(real_run, facts):
    even = _levelled([r for r in real_run if r["step"] < facts.ONSET])
    steps = sorted({r["step"] for r in even})[-5:]
    blip = [_slow_down(r, 0.5) if (r["rank"], r["step"]) == (1, steps[2]) else r for r in even]
    assert detect(blip, RANKS_PER_NODE, thresholds=facts.THRESHOLDS) == []
    persistent = [_slow_down(r, 0.5) if r["rank"] == 1 and r["step"] in steps[1:4] else r for r in even]
    findings = detect(persistent, RANKS_PER_NODE, thresholds=facts.THRESHOLDS)
    assert [(f.rank, f.steps_observed) for f in findings if f.segment == "compute"] == [(1, 3)]


def _synthetic(tp: int, dp: int, pp: int, steps: int, noise: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        for p in range(pp):
            for d in range(dp):
                for t in range(tp):
                    compute = 0.5 * (1 + rng.uniform(-noise, noise)) * (1.1 if p == pp - 1 else 1.0)
                    out.append({"step": step, "rank": t + tp * (d + dp * p), "tp": t, "pp": p, "dp": d,
                                "start": 1000.0 + step, "total": compute + 0.1,
                                "segments": {"data": 0.001, "forward": compute / 3, "backward": 2 * compute / 3,
                                             "optimizer": 0.0, "exposed_tp": 0.0, "exposed_pp": 0.1,
                                             "exposed_dp": 0.0}})
    return out


def test_noisy_large_job_flags_only_the_slow_rank():
    records = _synthetic(tp=4, dp=32, pp=2, steps=8, noise=0.1)
    target = 4 * 7 + 2  # tp 2, dp 7, stage 0
    records = [_slow_down(r, 0.2) if r["rank"] == target and r["step"] > 3 else r for r in records]
    findings = detect(records, ranks_per_node=8)
    assert [(f.rank, f.node, f.segment, f.dimension) for f in findings] == [(target, target // 8, "compute", "tp")]


def test_stages_doing_different_work_are_not_stragglers_but_a_much_slower_stage_is():
    assert detect(_synthetic(tp=1, dp=1, pp=4, steps=6, noise=0.05), ranks_per_node=1) == []
    slow_stage = [_slow_down(r, 0.5) if r["pp"] == 1 else r for r in _synthetic(tp=1, dp=1, pp=4, steps=6, noise=0.05)]
    assert [(f.rank, f.dimension) for f in detect(slow_stage, ranks_per_node=1)] == [(1, "pp")]


def test_monitor_reports_new_and_cleared_stragglers_as_valid_events(real_run, facts):
    SLOW_RANK, ONSET, STEPS = facts.SLOW_RANK, facts.ONSET, facts.STEPS
    monitor = StragglerMonitor(RANKS_PER_NODE, thresholds=facts.THRESHOLDS)
    seen_new, seen_cleared = [], []
    ordered = sorted(real_run, key=lambda r: r["step"])
    for step in range(1, STEPS + 1):
        new, cleared = monitor.update([r for r in ordered if r["step"] == step])
        seen_new += new
        seen_cleared += cleared
    assert {f.rank for f in seen_new} == {SLOW_RANK} and not seen_cleared
    recovered = [copy.deepcopy(r) for r in ordered if 1 < r["step"] < ONSET]  # not the warm-up step
    for r in recovered:
        r["step"] += STEPS  # the rank recovers: even steps again
    for step in range(STEPS + 2, STEPS + ONSET):
        _, cleared = monitor.update([r for r in recovered if r["step"] == step])
        seen_cleared += cleared
    assert {f.rank for f in seen_cleared} == {SLOW_RANK}
    event = decode(encode(to_event("demo", seen_new[0])), expect=Event)
    assert event.type == "node" and event.node == "node1" and "rank 3" in event.message
    assert event.detail["straggler"]["segment"] == "compute"
