"""The typed recovery record inside the job record: it round-trips through Redis's JSON, and a record
written before it (a `waiting_op` string, `fault` and `recovery` dicts) still loads."""
from __future__ import annotations

import json

from megascale.driver.recovery_record import Fault, Recovery, Timeline
from megascale.driver.state import JobRecord, JobState, NodeSlot, Phase

# A Recovering job's record as the driver wrote it before the typed record: self-checking n1 after a rank failed.
OLD = {
    "job": "j", "config": {"name": "j"}, "run_dir": "/r", "state": "Recovering", "reason": "rank 1 failed",
    "entered": 100.0, "incarnation": 1, "restarts": 0, "nodes": [
        {"node": "n0", "role": "active", "index": 0, "started": True, "dead": ""},
        {"node": "n1", "role": "active", "index": 1, "started": True, "dead": ""}],
    "next_node": 2, "waiting_op": "diagnose", "waiting": {"n0": 4, "n1": 5}, "waiting_since": 103.0,
    "fault": {"kind": "rank_failed", "node": "n1", "message": "rank 1 failed",
              "detail": {"rank": 1, "exit_code": 1, "detection_s": 0.5}},
    "cleaned": False, "created": 50.0, "suspects": ["n0", "n1"], "bad": {"n1": "self-check failed: gemm.flops"},
    "rechecked": [], "recovery": {"kind": "rank_failed", "node": "n1", "occurred": 99.5, "detected": 100.0,
                                  "step": 7, "incarnation": 1, "diagnosed": 104.0},
    "recoveries": [{"kind": "hang", "node": "n0", "total_s": 9.0}], "ideal_step_s": 0.1,
}


def test_a_record_from_before_the_typed_recovery_record_loads():
    rec = JobRecord.from_json(json.dumps(OLD))
    assert (rec.state, rec.phase, rec.waiting) == (JobState.RECOVERING, Phase.SELFCHECK, {"n0": 4, "n1": 5})
    assert rec.recovery == Recovery(
        fault=Fault("rank_failed", "n1", "rank 1 failed", {"rank": 1, "exit_code": 1, "detection_s": 0.5}),
        timeline=Timeline(occurred=99.5, detected=100.0, step=7, incarnation=1, diagnosed=104.0),
        suspects=["n0", "n1"], bad={"n1": "self-check failed: gemm.flops"})
    assert rec.recoveries == OLD["recoveries"]
    assert JobRecord.from_json(rec.to_json()) == rec


def test_a_record_with_no_fault_loads_without_a_recovery():
    old = {**OLD, "state": "Running", "waiting_op": "", "waiting": {}, "fault": None, "recovery": None,
           "suspects": [], "bad": {}}
    rec = JobRecord.from_json(json.dumps(old))
    assert (rec.phase, rec.recovery) == (Phase.IDLE, None)


def test_a_finished_recovery_keeps_its_fault_and_drops_its_timeline():
    rec = JobRecord(job="j", config={}, run_dir="/r", nodes=[NodeSlot("n0", "active", 0)], phase=Phase.STOP,
                    recovery=Recovery(Fault("hang", "n0", "no progress", {"step": None}), timeline=None))
    raw = rec.to_json()
    assert json.loads(raw)["phase"] == "stop" and json.loads(raw)["recovery"]["fault"]["kind"] == "hang"
    assert JobRecord.from_json(raw) == rec
