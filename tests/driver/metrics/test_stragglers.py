"""Straggler detection on a real multi-rank run, and on the main example's shape (tp2 pp2 dp2) replayed from a
fault-free run of it on a shared 2-core test host (data/gpt-tiny-8-ranks.jsonl.gz: 120 steps of
examples/gpt-tiny.yaml's model, 8 gloo ranks): slow ranks at every position, slow TP groups and stages,
warm-up and bursts of noise. The replays are deterministic: the host's real noise, the same every run."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from megascale.bench.stragglers import by_step, slow_down
from megascale.driver.metrics.straggler_report import describe, to_event
from megascale.driver.metrics.stragglers import StragglerMonitor, detect, slowness

from megascale.common.messages import Event, decode, encode

RANKS_PER_NODE = 2  # as in conftest.real_run
MAIN_RANKS_PER_NODE = 4  # the main example: 2 nodes of 4 ranks, one pipeline stage each
TRACE = Path(__file__).with_name("data") / "gpt-tiny-8-ranks.jsonl.gz"


def upto(records: list[dict], last: int) -> list[dict]:
    return [r for r in records if r["step"] <= last]


@pytest.fixture(scope="module")
def main_run() -> list[dict[int, dict]]:
    """The recorded fault-free run of the main example, step by step."""
    with gzip.open(TRACE, "rt") as f:
        return by_step([json.loads(line) for line in f])


def test_a_slowed_rank_of_a_real_run_is_named_within_a_few_steps_and_no_other_rank_ever_is(real_run, facts):
    first_seen = None
    for last in range(1, facts.STEPS + 1):
        findings = detect(upto(real_run, last), RANKS_PER_NODE)
        assert {f.rank for f in findings} <= {facts.SLOW_RANK}, [describe(f) for f in findings]
        if last < facts.ONSET:
            assert findings == [], f"false positive on the even steps up to {last}: {[describe(f) for f in findings]}"
        elif findings and first_seen is None:
            first_seen = last
    assert first_seen is not None and first_seen <= facts.ONSET + 5, f"detected at step {first_seen}"

    (found,) = [f for f in detect(real_run, RANKS_PER_NODE) if f.segment == "compute"]
    assert (found.rank, found.node, found.node_name) == (facts.SLOW_RANK, 1, "node1")
    assert (found.ranks, found.nodes) == ([facts.SLOW_RANK], [1])
    assert (found.tp, found.pp, found.dp) == (1, 0, 1)
    assert found.dimension == "tp"  # one rank slower than its TP peer on the same node: a device, not the node
    assert found.slowdown > 1.25 and found.confidence > 0.99  # its TP group's pace: the sleep and their TP waits
    assert facts.ONSET - 1 <= found.onset <= facts.ONSET + 2  # where its evidence shows the slowness began
    first, last = found.window
    # The newest sure window (a fading step keeps the evidence it was last reported on).
    assert facts.ONSET < last <= facts.STEPS and len(found.values) == len(found.peers_median) == last - first + 1
    evidence = zip(range(first, last + 1), found.values, found.peers_median)
    slow = [(v, m) for step, v, m in evidence if step >= facts.ONSET]
    assert slow and all(v > m for v, m in slow)  # the evidence: slower than its peers at every slow step
    scores = slowness(real_run)
    assert scores[facts.SLOW_RANK] == max(scores.values())


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


def test_a_slow_rank_is_named_at_every_tp_dp_pp_position_and_nothing_on_a_fault_free_run(main_run):
    steps, onset = main_run[:80], 50
    assert not monitor_over(steps).reported  # the same 80 steps without a fault
    for rank in range(8):
        monitor = monitor_over(slowed(steps, [rank], 2.0, onset))
        assert len(monitor.reported) == 1, [describe(f) for f in monitor.reported]
        (found,) = monitor.reported
        assert (found.rank, found.node, found.dimension, found.segment) == (rank, rank // 4, "tp", "compute")
        assert (found.tp, found.dp, found.pp) == (rank % 2, rank // 2 % 2, rank // 4)
        assert onset <= found.since < onset + 10 and onset - 2 <= found.onset <= onset + 2, describe(found)
        assert found.slowdown > 1.5 and found.cleared_at is None


def test_a_slow_tp_group_shows_as_dp_and_a_slow_stage_as_pp(main_run):
    # tp2 dp4: stage 0's four ranks at one step and, as DP replicas 2 and 3, at a step 60 later.
    replicas = [{**{k: r for k, r in a.items() if k < 4},
                 **{k + 4: {**r, "rank": k + 4, "dp": r["dp"] + 2, "step": a[0]["step"]}
                    for k, r in b.items() if k < 4}}
                for a, b in zip(main_run[:60], main_run[60:])]
    (group,) = monitor_over(slowed(replicas, [2, 3], 2.0, onset=40)).findings()
    assert (group.dimension, group.ranks, group.nodes) == ("dp", [2, 3], [0])  # level with each other: the node
    assert describe(group).startswith("straggler: TP group pp0 dp1 (ranks 2-3 on node0): compute ")
    stage = monitor_over(slowed(main_run[:80], [4, 5, 6, 7], 2.0, onset=50)).findings()
    assert [(f.dimension, f.ranks, f.nodes, f.pp) for f in stage] == [("pp", [4, 5, 6, 7], [1], 1)]
    assert stage[0].slowdown > 1.5
    assert describe(stage[0]).startswith("straggler: stage pp1 (ranks 4-7 on node1): compute ")


def test_a_monitor_remembers_only_its_newest_findings(main_run):
    steps = slowed(slowed(main_run[:100], [1], 2.0, onset=40), [6], 2.0, onset=70)
    every = [(f.rank, f.since) for f in monitor_over(steps).reported]
    assert len(every) >= 2 and {rank for rank, _ in every} == {1, 6}
    newest = StragglerMonitor(MAIN_RANKS_PER_NODE, keep_reported=1)
    for ranks in steps:
        newest.update(ranks.values())
    assert [(f.rank, f.since) for f in newest.reported] == every[-1:]
    assert {f.rank for f in newest.current.values()} == {1, 6}  # what stands is kept whatever the history


def test_warm_up_and_a_few_slow_steps_are_not_stragglers(main_run):
    steps = main_run[:80]
    assert not monitor_over(slowed(steps, [1], 5.0, onset=1, until=6)).reported  # the incarnation's warm-up
    assert not monitor_over(slowed(steps, [6], 2.0, onset=50, until=54)).reported  # a 4-step burst


def test_noisy_large_job_flags_only_the_slow_rank():
    rng = random.Random(0)
    tp, dp, pp, target = 4, 32, 2, 4 * 7 + 2  # the target: tp 2, dp 7, stage 0
    monitor = StragglerMonitor(8)
    for step in range(1, 31):
        records = []
        for p in range(pp):
            for d in range(dp):
                compute = [0.5 * (1 + rng.uniform(-0.1, 0.1)) * (1.1 if p else 1.0) for _ in range(tp)]
                if (p, d, step > 10) == (0, target // tp, True):
                    compute[target % tp] *= 1.5
                for t in range(tp):  # TP peers wait for the group's slowest inside their forward
                    waited = max(compute) - compute[t]
                    records.append({"step": step, "rank": t + tp * (d + dp * p), "tp": t, "pp": p, "dp": d,
                                    "start": 1000.0 + step, "total": max(compute) + 0.1,
                                    "segments": {"data": 0.001, "forward": max(compute), "exposed_tp": waited,
                                                 "exposed_pp": 0.1}})
        monitor.update(records)
    found = [(f.rank, f.node, f.segment, f.dimension) for f in monitor.reported]
    assert found == [(target, target // 8, "compute", "tp")]


def test_monitor_reports_new_and_cleared_findings_as_valid_events(real_run, facts):
    monitor = StragglerMonitor(RANKS_PER_NODE, world_size=4)
    seen_new, seen_cleared, events = [], [], []
    ordered = sorted(real_run, key=lambda r: r["step"])
    for step in range(1, facts.STEPS + 1):
        new, cleared = monitor.update([r for r in ordered if r["step"] == step])
        seen_new += new
        seen_cleared += cleared
        events += [encode(to_event("demo", f)) for f in new]  # as the driver publishes them: at once
    assert {f.rank for f in seen_new} == {facts.SLOW_RANK} and not seen_cleared
    # The rank recovers, for longer than the longest window: every rank computes as the first rank of its stage
    # did at an even step (uniform, so that a noisy even step of this shared host replayed 40 times cannot
    # keep another rank's finding standing).
    even = {r["step"]: {} for r in ordered if 5 < r["step"] < facts.ONSET}
    for r in ordered:
        if r["step"] in even:
            even[r["step"]][r["rank"]] = r
    for i in range(40):
        step = list(even.values())[i % len(even)]
        first = {r["pp"]: r for r in sorted(step.values(), key=lambda r: r["rank"], reverse=True)}
        recovered = {rank: {**first[r["pp"]], **{k: r[k] for k in ("rank", "tp", "dp", "pp")}}
                     for rank, r in step.items()}
        _, cleared = monitor.update([{**r, "step": facts.STEPS + 1 + i} for r in recovered.values()])
        seen_cleared += cleared
    assert {f.rank for f in seen_cleared} == {facts.SLOW_RANK} and monitor.current == {}
    assert seen_cleared[0].cleared_at is not None and seen_cleared[0] in monitor.reported
    event = decode(events[0], expect=Event)
    assert event.type == "node" and event.node == "node1" and "rank 3" in event.message
    assert event.detail["straggler"]["segment"] == "compute" and event.detail["straggler"]["confidence"] > 0.99
