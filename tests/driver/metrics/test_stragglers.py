"""Straggler detection on a real multi-rank run, and on the main example's shape (tp2 pp2 dp2) replayed
from that run's fault-free steps: slow ranks at every position, slow TP groups and stages, noise bursts."""
from __future__ import annotations

import copy
import random

from megascale.bench.stragglers import slow_down
from megascale.driver.metrics.stragglers import StragglerMonitor, describe, detect, slowness, to_event

from megascale.common.messages import Event, decode, encode

RANKS_PER_NODE = 2  # as in conftest.real_run
MAIN_RANKS_PER_NODE = 4  # the main example: 2 nodes of 4 ranks, one pipeline stage each


def upto(records: list[dict], last: int) -> list[dict]:
    return [r for r in records if r["step"] <= last]


def test_a_slowed_rank_of_a_real_run_is_named_within_a_few_steps_and_no_other_rank_ever_is(real_run, facts):
    first_seen = None
    for last in range(1, facts.STEPS + 1):
        findings = detect(upto(real_run, last), RANKS_PER_NODE)
        assert {f.rank for f in findings} <= {facts.SLOW_RANK}, [describe(f) for f in findings]
        if last < facts.ONSET:
            assert findings == [], f"false positive on the even steps up to {last}: {[describe(f) for f in findings]}"
        elif findings and first_seen is None:
            first_seen = last
    assert first_seen is not None and first_seen <= facts.ONSET + 7, f"detected at step {first_seen}"

    (found,) = [f for f in detect(real_run, RANKS_PER_NODE) if f.segment == "compute"]
    assert (found.rank, found.node, found.node_name) == (facts.SLOW_RANK, 1, "node1")
    assert (found.ranks, found.nodes) == ([facts.SLOW_RANK], [1])
    assert (found.tp, found.pp, found.dp) == (1, 0, 1)
    assert found.dimension == "tp"  # one rank slower than its TP peer on the same node: a device, not the node
    assert found.slowdown > 1.5 and found.confidence > 0.999 and found.onset >= facts.ONSET
    first, last = found.window
    assert facts.ONSET <= first <= last == facts.STEPS
    assert len(found.values) == len(found.peers_median) == last - first + 1
    assert all(v > m for v, m in zip(found.values, found.peers_median))  # the evidence: slower at every step
    scores = slowness(real_run)
    assert scores[facts.SLOW_RANK] == max(scores.values())


def main_shape(real_run, facts, steps: int, seed: int = 0) -> list[dict[int, dict]]:
    """`steps` steps of the main example's shape (8 ranks, tp2 pp2 dp2) from the real run's fault-free steps:
    its warm-up, then its later even steps drawn at random; each stage a different real step, stage 1 doing
    1.4x the compute of stage 0 (a stage with the loss head)."""
    rng = random.Random(seed)
    by_step = {}
    for r in real_run:
        if r["step"] < facts.ONSET:
            by_step.setdefault(r["step"], {})[r["rank"]] = r
    warm, even = sorted(by_step)[:5], sorted(by_step)[5:]
    out = []
    for i in range(steps):
        picks = [warm[i]] * 2 if i < len(warm) else [rng.choice(even), rng.choice(even)]
        ranks = {}
        for pp, step in enumerate(picks):
            for rank, r in by_step[step].items():
                rec = slow_down({rank: r}, rank, 1.4)[rank] if pp else copy.deepcopy(r)
                ranks[rank + 4 * pp] = {**rec, "rank": rank + 4 * pp, "pp": pp, "step": i + 1}
        out.append(ranks)
    return out


def monitor_over(steps: list[dict[int, dict]]) -> StragglerMonitor:
    monitor = StragglerMonitor(MAIN_RANKS_PER_NODE)
    for ranks in steps:
        monitor.update(ranks.values())
    return monitor


def slowed(steps: list[dict[int, dict]], ranks: list[int], factor: float, onset: int,
           until: int = 1 << 30) -> list[dict[int, dict]]:
    out = []
    for i, step in enumerate(steps, start=1):
        for rank in ranks if onset <= i < until else ():
            step = slow_down(step, rank, factor)
        out.append(step)
    return out


def test_a_slow_rank_is_named_at_every_tp_dp_pp_position_and_nothing_on_a_fault_free_run(real_run, facts):
    steps, onset = main_shape(real_run, facts, 40), 20
    assert monitor_over(steps).reported == []  # the same 40 steps without a fault; stage 1 does more work
    for rank in range(8):
        monitor = monitor_over(slowed(steps, [rank], 2.0, onset))
        (found,) = monitor.reported
        assert (found.rank, found.node, found.dimension, found.segment) == (rank, rank // 4, "tp", "compute")
        assert (found.tp, found.dp, found.pp) == (rank % 2, rank // 2 % 2, rank // 4)
        assert onset <= found.since < onset + 10, describe(found)
        assert found.slowdown > 1.5 and found.cleared_at is None


def test_a_slow_tp_group_shows_as_dp_and_a_slow_stage_as_pp(real_run, facts):
    steps = main_shape(real_run, facts, 40)
    group = monitor_over(slowed(steps, [2, 3], 2.0, onset=20)).findings()
    assert sorted((f.rank, f.dimension) for f in group) == [(2, "dp"), (3, "dp")]  # level with each other
    stage = monitor_over(slowed(steps, [4, 5, 6, 7], 2.0, onset=24)).findings()
    assert [(f.dimension, f.ranks, f.nodes, f.pp) for f in stage] == [("pp", [4, 5, 6, 7], [1], 1)]
    assert stage[0].slowdown > 1.5 and stage[0].usual > 1.2  # against its own usual pace, which is slower
    assert describe(stage[0]).startswith("straggler: stage pp1 (ranks 4-7 on node1): compute ")


def test_warm_up_and_a_few_slow_steps_are_not_stragglers(real_run, facts):
    steps = main_shape(real_run, facts, 40)
    assert monitor_over(slowed(steps, [1], 5.0, onset=1, until=6)).reported == []  # the incarnation's warm-up
    assert monitor_over(slowed(steps, [6], 1.6, onset=20, until=24)).reported == []  # a 4-step burst


def test_noisy_large_job_flags_only_the_slow_rank():
    rng = random.Random(0)
    tp, dp, pp, target = 4, 32, 2, 4 * 7 + 2  # the target: tp 2, dp 7, stage 0
    monitor = StragglerMonitor(8)
    for step in range(1, 21):
        records = []
        for p in range(pp):
            for d in range(dp):
                for t in range(tp):
                    compute = 0.5 * (1 + rng.uniform(-0.1, 0.1)) * (1.1 if p else 1.0)
                    compute *= 1.5 if (t + tp * d, p, step > 10) == (target, 0, True) else 1.0
                    records.append({"step": step, "rank": t + tp * (d + dp * p), "tp": t, "pp": p, "dp": d,
                                    "start": 1000.0 + step, "total": compute + 0.1,
                                    "segments": {"data": 0.001, "forward": compute, "exposed_pp": 0.1}})
        monitor.update(records)
    found = [(f.rank, f.node, f.segment, f.dimension) for f in monitor.reported]
    assert found == [(target, target // 8, "compute", "tp")]


def test_monitor_reports_new_and_cleared_findings_as_valid_events(real_run, facts):
    monitor = StragglerMonitor(RANKS_PER_NODE, world_size=4)
    seen_new, seen_cleared = [], []
    ordered = sorted(real_run, key=lambda r: r["step"])
    for step in range(1, facts.STEPS + 1):
        new, cleared = monitor.update([r for r in ordered if r["step"] == step])
        seen_new += new
        seen_cleared += cleared
    assert {f.rank for f in seen_new} == {facts.SLOW_RANK} and not seen_cleared
    even = [copy.deepcopy(r) for r in ordered if 5 < r["step"] < facts.ONSET]
    for lap in range(4):  # the rank recovers: even steps again, until its evidence is gone
        for step in sorted({r["step"] for r in even}):
            _, cleared = monitor.update([{**r, "step": facts.STEPS + lap * 100 + step} for r in even
                                         if r["step"] == step])
            seen_cleared += cleared
    assert {f.rank for f in seen_cleared} == {facts.SLOW_RANK} and monitor.current == {}
    assert seen_cleared[0].cleared_at is not None and seen_cleared[0] in monitor.reported
    event = decode(encode(to_event("demo", seen_new[0])), expect=Event)
    assert event.type == "node" and event.node == "node1" and "rank 3" in event.message
    assert event.detail["straggler"]["segment"] == "compute" and event.detail["straggler"]["confidence"] > 0.99
