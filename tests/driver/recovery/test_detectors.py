"""The driver's other fault detectors end to end: a NaN loss, a fatal error line in a running rank's
log, and a straggler node evicted under `control.evict_stragglers`. Real Redis, tansu, driver and
executors; stand-in ranks (driver/sim_rank.py) inject each fault through its SIM_* variables, the
first two once per job, so the restarted incarnation runs clean.
"""
from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from megascale.driver.metrics.store import ParquetStore
from megascale.driver.metrics.stragglers import segment_value
from megascale.driver.sim_rank import step_timings
from megascale.driver.state import JobState
from megascale.common.rankspec import RankSpec
from megascale.timers import SEGMENTS

from control_plane_support import events, fast, launch


def roles(rec) -> dict[str, str]:
    return {s.node: s.role for s in rec.nodes}


def test_stand_in_timings_separate_compute_from_waiting():
    spec = RankSpec(job="j", node="n0", incarnation=1, world_size=4, config={"parallelism": {"dp": 4}},
                    run_dir="/nonexistent", init_method="", rank=2)
    rec = step_timings(spec, step=7, start=0.0, compute=0.3, waited=0.2)
    assert set(rec["segments"]) == set(SEGMENTS)  # the real timers' names, every one of them
    assert (rec["dp"], rec["total"]) == (2, 0.5)
    assert rec["segments"]["exposed_dp"] == 0.2 and segment_value(rec, "compute") == 0.3


def test_nan_loss_restarts_the_job(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("SIM_NAN_AT", "8")  # the reporting rank (3, on n1) diverges at step 8, once
    job = launch(capsys, fast(tmp_path, "rd-nan", steps=40), "rd-nan")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 60, "the NaN loss to be detected and the job restarted")
    fault = rec.recovery.fault
    assert fault.kind == "nan_loss" and fault.node == "n1", fault
    found = re.fullmatch(r"loss is nan at step (\d+) on n1", fault.message)
    assert found and 8 <= int(found[1]) < 40, fault
    assert rec.restarts == 1 and roles(rec) == {"n0": "active", "n1": "active", "n2": "spare"}  # a restart, no eviction
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 40 and final["restarts"] == 1, final
    assert [r["kind"] for r in final["recoveries"]] == ["nan_loss"], final["recoveries"]
    assert 0 < final["recoveries"][0]["detection_s"] <= 1.0, final["recoveries"]  # from the heartbeat that bore it
    assert final["loss"] == 10.0 / 40  # incarnation 2 did not diverge again
    log = events(job)
    assert f"event: {fault.message}" in log and "recovered from nan_loss" in log
    assert "Running -> Recovering: loss is nan" in log and "decision: restart" in log
    job.assert_services_gone()


def test_fatal_error_line_of_a_running_rank_restarts_the_job(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("SIM_ERROR_AT", "1:8")  # rank 1 (on n0) logs an NCCL watchdog timeout at step 8, trains on
    job = launch(capsys, fast(tmp_path, "rd-err", steps=40), "rd-err")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 60, "the error line to be detected and the job restarted")
    fault = rec.recovery.fault
    assert fault.kind == "rank_error" and fault.node == "n0", fault
    assert fault.detail["error"] == "nccl_timeout" and fault.detail["rank"] == 1, fault
    assert fault.message.startswith(  # torch's "[rank1]:" prefix stripped
        "rank 1 on n0 logged nccl_timeout: [E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=8,"), fault
    assert rec.restarts == 1 and roles(rec) == {"n0": "active", "n1": "active", "n2": "spare"}
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 40 and final["restarts"] == 1, final
    assert [r["kind"] for r in final["recoveries"]] == ["rank_error"], final["recoveries"]
    assert 0 < final["recoveries"][0]["detection_s"] <= 1.0, final["recoveries"]  # from the error line's time
    log = events(job)
    assert "event: rank 1 on n0 logged nccl_timeout" in log and "recovered from rank_error" in log
    node_log = Path(job.handle.run_dir, "nodes", "n0", "executor.log").read_text()
    assert "exited with code" not in node_log  # the rank was running when the driver acted: it stopped it
    assert Path(job.handle.run_dir, "nodes", "n0", "rank1.log").read_text().count("Watchdog caught") == 1
    job.assert_services_gone()


def test_straggler_node_is_evicted_and_the_spare_runs_at_full_speed(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("SIM_SLOW_NODE", "n1:3")  # n1's ranks (2, 3) compute 3x as long; not n2's after it takes over
    job = launch(capsys, fast(tmp_path, "rd-slow", steps=40, evict_stragglers=True), "rd-slow")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 60, "the straggler to be evicted and the job restarted")
    fault = rec.recovery.fault
    assert fault.kind == "straggler" and fault.node == "n1", fault
    assert fault.detail["rank"] in (2, 3) and fault.detail["segment"] == "compute", fault
    assert fault.detail["dimension"] == "dp", fault  # the whole node, not one device: level with its tp peers
    assert 2.0 <= fault.detail["slowdown"] <= 4.5, fault
    found = re.fullmatch(r"straggler: rank [23] on n1 \(tp0 pp0 dp[23]\): compute \d\.\d\dx its dp peers "
                         r"\(\+\d+\.\d ms/step\) in (\d) of its last (\d) steps; evicting its node "
                         r"\(control.evict_stragglers\)", fault.message)
    assert found and 3 <= int(found[1]) <= int(found[2]) <= 5, fault  # k=3 of the n=5 newest steps (fewer at first)
    assert rec.restarts == 1 and roles(rec) == {"n0": "active", "n1": "evicted", "n2": "active", "n3": "spare"}
    assert rec.slot("n2").index == 1  # the spare holds n1's position: ranks 2 and 3

    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 40 and final["restarts"] == 1, final
    assert [r["kind"] for r in final["recoveries"]] == ["straggler"], final["recoveries"]
    assert final["stragglers"] == [], final  # nobody is slow in incarnation 2
    log = events(job)
    assert "evicted n1 (straggler); n2 takes its place" in log and "recovered from straggler" in log
    findings = re.findall(r"event: straggler: rank (\d) on (n\d)", log)
    assert findings and all(node == "n1" and rank in "23" for rank, node in findings), findings

    rows = [r for r in ParquetStore(Path(job.handle.run_dir) / "metrics").read("rd-slow") if r["incarnation"] == 2]
    assert {r["node"] for r in rows if r["rank"] in (2, 3)} == {"n2"}, rows[:4]
    step_s = float(os.environ["SIM_STEP_S"])
    for rank in range(4):  # the slowness followed n1 out: the replacement computes at full speed
        compute = statistics.median(segment_value(r, "compute") for r in rows if r["rank"] == rank)
        assert compute < 1.5 * step_s, (rank, compute)
    job.assert_services_gone()
