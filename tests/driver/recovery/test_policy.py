"""Recovery's decisions without a cluster: who is self-checked, what the policy decides and evicts, and
how a recovery's time splits into MTTR phases (the end-to-end runs are in test_recovery*.py)."""
from __future__ import annotations

import time

import pytest

from megascale.common.messages import Heartbeat
from megascale.config import from_dict
from megascale.driver.ingest import NodeView
from megascale.driver.recovery import policy, selfcheck, timings
from megascale.driver.pool import NodePool
from megascale.driver.recovery.detection import Liveness
from megascale.driver.recovery_record import Fault, Recovery, Timeline
from megascale.driver.state import EVICTED_KEPT, JobRecord, JobState, NodeSlot

from control_plane_support import StubBackend  # noqa: E402 - tests/driver is on sys.path (conftest)


def config(**control):
    return from_dict({"name": "j", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                      "parallelism": {"pp": 2, "dp": 2}, "batch": {"micro": 1, "global": 2},
                      "cluster": {"nodes": 4}, "control": control})


def record(restarts: int = 0) -> JobRecord:  # four nodes of one rank each: n0 n1 (dp), n0 n2 (pp)
    return JobRecord(job="j", config={}, run_dir="/r", incarnation=1, restarts=restarts,
                     nodes=[NodeSlot(f"n{i}", "active", i) for i in range(4)])


def crashed(node: str = "n0") -> Recovery:
    return Recovery(Fault("rank_failed", node, f"rank on {node} exited with code 1"), timeline=None)


def test_self_check_covers_the_suspect_and_its_group_peers_only():
    rec, cfg = record(), config()
    assert selfcheck.plan(rec, crashed(), cfg, gone=lambda node: False) == (["n0", "n1", "n2"], [])
    assert selfcheck.plan(rec, crashed(), cfg, gone=lambda node: node == "n1") == (["n0", "n2"], [])
    assert selfcheck.plan(rec, crashed(), config(selfcheck=False), gone=lambda node: False) == ([], [])
    assert selfcheck.plan(rec, crashed(), config(auto_recover=False), gone=lambda node: False) == ([], [])


def test_a_dead_node_restarts_at_once_and_a_localised_hang_checks_only_its_suspects_first():
    rec, cfg = record(), config()
    dead = Recovery(Fault("node_dead", "n0", "node n0: no heartbeat for 6.1 s"), timeline=None)
    rec.slot("n0").dead = "no heartbeat"
    assert selfcheck.plan(rec, dead, cfg, gone=lambda node: node == "n0") == ([], ["n1", "n2"])  # its peers
    rec.slot("n0").dead = ""
    hang = Recovery(Fault("hang", "n1", "no training progress"), timeline=None, suspects=["n1"])
    assert selfcheck.plan(rec, hang, cfg, gone=lambda node: False) == (["n1"], ["n0", "n3"])  # its dp and pp peers
    hang.bad["n0"] = "self-check failed: gemm.flops"  # found bad already: not checked again
    assert selfcheck.plan(rec, hang, cfg, gone=lambda node: False) == (["n1"], ["n3"])
    unlocalised = Recovery(Fault("hang", None, "no training progress"), timeline=None)
    assert selfcheck.plan(rec, unlocalised, cfg, gone=lambda node: False) == (["n0", "n1", "n2", "n3"], [])


def test_policy_restarts_evicting_the_dead_and_the_failed_until_restarts_run_out():
    rec, cfg, recovery = record(), config(), crashed()
    recovery.bad["n1"] = "self-check failed: gemm.flops"
    rec.slot("n3").dead = "no heartbeat"
    decision, reason = policy.decide(rec, recovery, ["n3"], cfg)
    assert decision == "restart" and reason.endswith(
        "evicting n1 (self-check failed: gemm.flops), n3 (dead); restart 1/3"), reason
    assert policy.evictions(rec, recovery, ["n3"], cfg) == {"n1": "self-check failed: gemm.flops",
                                                            "n3": "dead (no heartbeat)"}
    decision, reason = policy.decide(record(restarts=3), recovery, [], cfg)
    assert decision == "fail" and "gave up after 3 restarts (control.max_restarts)" in reason


def test_without_auto_recover_a_dead_node_pauses_the_job_for_a_human():
    manual = config(auto_recover=False)
    decision, reason = policy.decide(record(), crashed("n3"), ["n3"], manual)
    assert decision == "pause" and "`megascale evict j n3` replaces it with a spare" in reason, reason
    assert policy.evictions(record(), crashed("n3"), ["n3"], manual) == {}


@pytest.mark.parametrize("kind, detail, expected", [("rank_error", {"at": 95.0}, 95.0), ("straggler", {}, None)])
def test_a_fault_dates_from_its_evidence(kind, detail, expected):
    rec = record()
    rec.entered = 90.0
    timeline = timings.start(rec, Fault(kind, "n0", "m", detail), step=7, chaos=None, silence=lambda node: 0.0,
                             hang_since=0.0)
    assert timeline.occurred == (expected or timeline.detected) and (timeline.step, timeline.incarnation) == (7, 1)


def view(node: str, step: int, restored: int) -> NodeView:
    hb = Heartbeat(job="j", node=node, host="h", ip="127.0.0.1", boot_id="b", seq=1, time=time.time(), interval_s=0.5,
                   phase="running", incarnation=2, step=step, restored_step=restored)
    return NodeView(hb, received=time.monotonic(), wall=time.time())


def test_a_recovery_ends_when_the_next_incarnation_is_back_at_the_fault_step():
    rec, now = record(), time.time()
    rec.incarnation = 2  # the restarted incarnation
    rec.recovery = Recovery(crashed().fault, Timeline(occurred=now - 10, detected=now - 9, step=7, incarnation=1,
                                                      diagnosed=now - 6))
    views = {"n0": view("n0", 5, restored=4)}
    assert timings.track(rec, views, {"step": 5}) is None  # resumed from step 4: three steps to replay
    assert rec.recovery.timeline.restored_step == 4 and rec.recoveries == []
    done = timings.track(rec, views, {"step": 7})
    assert done == rec.recoveries[0] and rec.recovery.timeline is None
    assert (done["kind"], done["steps_lost"], done["detection_s"], done["diagnosis_s"]) == ("rank_failed", 3, 1, 3)
    assert done["total_s"] == pytest.approx(done["detection_s"] + done["diagnosis_s"] + done["restart_s"]
                                            + done["catchup_s"], abs=0.05)
    assert timings.mttr(rec) == done["total_s"]


def test_a_recovery_is_timed_by_when_its_node_saw_the_steps_not_by_when_heartbeats_came():
    rec, now = record(), time.time()
    rec.incarnation = 2
    rec.recovery = Recovery(crashed().fault, Timeline(occurred=now - 10, detected=now - 9, step=7, incarnation=1,
                                                      diagnosed=now - 6))
    views = {"n0": view("n0", 5, restored=4)}
    assert timings.track(rec, views, {"step": 5, "seen": now - 3, "step_time": 0.5}) is None
    assert rec.recovery.timeline.resumed == now - 3  # the first step, as its node saw it
    # The next heartbeat shows step 9, seen 1 s ago: step 7, the fault's, came two 0.5 s steps before it.
    done = timings.track(rec, views, {"step": 9, "seen": now - 1, "step_time": 0.5})
    assert done["restart_s"] == 3.0 and done["catchup_s"] == 1.0 and done["total_s"] == 8.0


def test_ettr_counts_the_time_that_trained_new_steps_not_start_up_restarts_or_replays():
    rec, now = record(), time.time()
    rec.created = now - 100.0
    # Steps as heartbeats show them (by when their node saw them): the first at 10 s (start-up before it is
    # lost), one a second to step 6 at 15 s (5 s), then a fault: incarnation 2 resumes at step 3 at 35 s (the
    # restart is lost), replays steps 4-6 to 38 s (lost: no new data) and trains steps 7-8 to 40 s (2 s).
    for step, seen_s in [(1, 10), (3, 12), (3, 12), (4, 13), (6, 15)]:
        timings.track(rec, {}, {"step": step, "step_time": 1.0, "seen": now - 100 + seen_s})
    assert timings.ettr(record()) is None  # no step seen yet
    rec.incarnation = 2
    for step, seen_s in [(3, 35), (5, 37), (8, 40)]:  # steps 6-8 in 3 s: 7 and 8 are new
        timings.track(rec, {}, {"step": step, "step_time": 1.0, "seen": now - 100 + seen_s})
    assert rec.furthest_step == 8 and rec.productive_s == pytest.approx(5.0 + 2.0)
    assert timings.ettr(rec) == pytest.approx(7.0 / 100, abs=0.001)


def test_ettr_counts_slow_steps_as_training_and_stops_its_clock_when_the_job_ends():
    rec, now = record(), time.time()
    rec.created = seen = now - 400.0
    # Step 1 at 1 s (start-up), 100 more steps of 1 s, then 99 of 2 s (a loaded host): all of those trained.
    for step in range(1, 201):
        seen += 1.0 if step <= 101 else 2.0
        timings.track(rec, {}, {"step": step, "step_time": 1.0, "seen": seen})
    assert rec.productive_s == pytest.approx(298.0)
    assert timings.ettr(rec) == pytest.approx(298.0 / 400, abs=0.01)
    rec.move(JobState.INITIALIZING)
    rec.move(JobState.RUNNING)
    rec.move(JobState.SUCCEEDED, "trained to step 200")
    rec.entered = rec.created + 350.0  # ended 50 s ago: the wall clock stopped then
    assert timings.ettr(rec) == pytest.approx(298.0 / 350, abs=0.001)


def test_weeks_of_recoveries_keep_the_newest_in_full_and_count_and_time_them_all():
    """The record and the status are rewritten every pass: hundreds of recoveries must not grow them."""
    rec, now = record(), time.time()
    rec.recoveries = [{"kind": "hang", "node": "n0", "total_s": 4.0}]  # a record from before the count
    for i in range(2, 2 + 2 * timings.KEPT):
        rec.incarnation = i
        rec.recovery = Recovery(crashed().fault, Timeline(occurred=now - 10, detected=now - 9, step=7,
                                                          incarnation=i - 1, diagnosed=now - 6))
        views = {"n0": view("n0", 7, restored=7)}
        assert timings.track(rec, views, {"step": 7, "seen": now - 2.0}) is not None
    assert rec.recovered == 1 + 2 * timings.KEPT and len(rec.recoveries) == timings.KEPT
    assert [r["n"] for r in rec.recoveries] == list(range(rec.recovered - timings.KEPT + 1, rec.recovered + 1))
    assert timings.mttr(rec) == pytest.approx((4.0 + 2 * timings.KEPT * 8.0) / rec.recovered, abs=0.01)
    status = {"recovered": rec.recovered, "recoveries": rec.recoveries}
    assert timings.recovered(status) == rec.recovered
    assert [r["n"] for r in timings.recoveries_after(status, rec.recovered - 2)] == [rec.recovered - 1, rec.recovered]


def test_a_status_lists_the_newest_evicted_nodes_and_counts_them_all():
    from rich.console import Console

    from megascale.driver.display import job_table
    from megascale.driver.reconcile import EVICTED_SHOWN

    rec = record()
    rec.nodes = [NodeSlot(f"n{i}", "evicted") for i in range(30)] + [NodeSlot("n30", "active", 0),
                                                                     NodeSlot("n31", "spare")]
    shown, evicted = rec.shown_slots(EVICTED_SHOWN), len(rec.slots("evicted"))
    assert evicted == 30 and [s.node for s in shown] == [f"n{i}" for i in range(30 - EVICTED_SHOWN, 32)]
    status = {"state": "Running", "evicted": evicted, "recovered": 31, "driver": "d",
              "nodes": [{"node": s.node, "role": s.role} for s in shown]}
    console = Console(width=200, record=True)
    console.print(job_table("j", status))
    text = console.export_text()
    assert f"(and {30 - EVICTED_SHOWN} nodes evicted before these)" in text and "recoveries 31" in text


def test_the_record_keeps_the_newest_evicted_nodes_and_counts_all_however_many_faults_evict():
    """Weeks of faults evict hundreds of nodes: the record (rewritten every pass) and what the driver knows of
    nodes (heartbeat views, start times) stay the size of the newest EVICTED_KEPT; the count stays whole."""
    cfg = config()
    backend = StubBackend()
    pool, rec, sizes = NodePool(backend, cfg), JobRecord(job="j", config={}, run_dir="/r"), {}
    for evictions in range(1, 301):
        pool.ensure(rec, spares=1)
        pool.evict(rec, rec.slots("active")[0].node)
        sizes[evictions] = len(rec.to_json())
    assert rec.evicted == 300 and JobRecord.from_json(rec.to_json()).evicted == 300
    evicted = [int(s.node[1:]) for s in rec.slots("evicted")]
    assert evicted == list(range(303 - EVICTED_KEPT, 303))  # n0, then each spare (n4, n5, ...) put at position 0
    assert backend.forgotten == ["n0"] + [f"n{i}" for i in range(4, 303 - EVICTED_KEPT)]  # what the backend kept
    assert abs(sizes[300] - sizes[200]) < 10  # the same but for a digit or two of its counts: no slot more
    assert sizes[EVICTED_KEPT] - sizes[10] > 1000  # (each slot kept is ~50 bytes)
    assert len(rec.slots("active")) == 4 and rec.next_node == 304

    gone = Recovery(Fault("node_dead", "n0", "node n0: no heartbeat"), timeline=None, bad={"n4": "gemm"})
    assert policy.evictions(rec, gone, ["n0"], cfg) == {}  # forgotten nodes: nothing to evict, no lookup fails

    ever = [f"n{i}" for i in range(rec.next_node)]
    liveness = Liveness({node: object() for node in ever}, StubBackend(), cfg)
    liveness.born = {node: 0.0 for node in ever}
    liveness.forget_others(rec.node_names())
    assert set(liveness.views) == set(liveness.born) == rec.node_names()
    assert len(rec.node_names()) == EVICTED_KEPT + 4  # and the active ones
