"""The driver's other fault detectors end to end: a NaN loss, a fatal error line in a running rank's
log, and a rank slowed by `megascale chaos slow-rank` whose node is evicted under `control.evict_stragglers`.
Real Redis, tansu, driver and executors; stand-in ranks (driver/sim_rank.py) inject the first two faults
through their SIM_* variables, once per job, so the restarted incarnation runs clean.
"""
from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import pytest
from megascale.cli import main
from megascale.config import ControlConfig
from megascale.driver.metrics.store import ParquetStore
from megascale.driver.metrics.stragglers import Finding, segment_value
from megascale.driver.recovery.policy import straggler_to_evict
from megascale.driver.sim_rank import step_timings
from megascale.driver.state import JobState
from megascale.common.rankspec import RankSpec
from megascale.timers import SEGMENTS

from control_plane_support import cli, events, fast, launch


def roles(rec) -> dict[str, str]:
    return {s.node: s.role for s in rec.nodes}


def test_stand_in_timings_separate_compute_from_waiting():
    spec = RankSpec(job="j", node="n0", incarnation=1, world_size=4, config={"parallelism": {"dp": 4}},
                    run_dir="/nonexistent", init_method="", rank=2)
    rec = step_timings(spec, step=7, start=0.0, compute=0.3, waited=0.2)
    assert set(rec["segments"]) == set(SEGMENTS)  # the real timers' names, every one of them
    assert (rec["dp"], rec["total"]) == (2, 0.5)
    assert rec["segments"]["exposed_dp"] == 0.2 and segment_value(rec, "compute") == 0.3


def finding(**fields) -> Finding:
    base = dict(rank=6, node=1, node_name="n1", segment="compute", dimension="tp", slowdown=2.0, excess_s=0.1,
                confidence=0.9999, window=[10, 17], values=[], peers_median=[], usual=1.0, noise=0.2, since=17,
                onset=10, last_step=19, tp=0, pp=1, dp=1, ranks=[6], trail=[0.9999] * 3, nodes=[1])
    return Finding(**{**base, **fields})


def test_evict_stragglers_acts_only_on_a_sure_lasting_finding_on_one_node():
    control = ControlConfig(evict_stragglers=True, straggler_evict_after=3, straggler_evict_confidence=0.999)
    sure = finding()
    assert straggler_to_evict([sure], control) is sure
    assert straggler_to_evict([finding(trail=[0.99, 0.9999, 0.9999])], control) is None  # not sure long enough
    assert straggler_to_evict([finding(trail=[0.9999] * 2)], control) is None  # too new
    stage = finding(dimension="pp", ranks=[4, 5, 6, 7], nodes=[1, 2])
    assert straggler_to_evict([stage], control) is None  # a stage over two nodes names no node to replace
    surer = finding(rank=2, confidence=0.99999)
    assert straggler_to_evict([sure, surer], control) is surer


def test_chaos_takes_kind_and_job_in_either_order_and_warns_on_the_old_slow(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGASCALE_HOME", str(tmp_path))
    assert main(["chaos", "slow-rank", "nojob", "--rank", "6", "--factor", "2", "--for", "20"]) == 2
    assert "megascale chaos: no job named 'nojob'" in capsys.readouterr().err
    assert main(["chaos", "nojob", "slow"]) == 2
    err = capsys.readouterr().err
    assert "`slow` is now `fail-selfcheck`" in err and "no job named 'nojob'" in err
    assert main(["chaos", "nojob", "slowly"]) == 2
    assert "kind 'slowly': one of kill-rank" in capsys.readouterr().err


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


@pytest.mark.slow
def test_a_slowed_rank_is_found_and_its_node_evicted_and_no_other(tmp_path, capsys, wait):
    """`megascale chaos slow-rank` throttles rank 2 (on n1) 2.5x; the driver names it, evicts n1 once the
    finding is sure (control.straggler_evict_*), and the spare that takes n1's ranks runs at full speed."""
    job = launch(capsys, fast(tmp_path, "rd-slow", steps=80, evict_stragglers=True), "rd-slow")
    wait(lambda: (job.status().get("step") or 0) >= 12, 60, "training past its warm-up")
    said = cli(capsys, "chaos", "slow-rank", "rd-slow", "--rank", "2", "--factor", "2.5", "--for", "60")
    assert said.strip() == "rank 2 on n1 computes 2.5x slower for 60 s", said
    chaos_at = job.store.last_chaos()["time"]
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 90, "the straggler to be evicted and the job restarted")
    fault = rec.recovery.fault
    assert fault.kind == "straggler" and fault.node == "n1", fault
    assert fault.detail["rank"] == 2 and fault.detail["segment"] == "compute", fault
    assert fault.detail["dimension"] == "dp", fault  # tp=1: its TP group is itself, slower than the other replicas
    assert fault.detail["confidence"] >= 0.99999 and fault.detail["steps_reported"] >= 5, fault
    assert re.fullmatch(r"straggler: rank 2 on n1 \(tp0 pp0 dp2\): compute \d\.\d\dx its dp peers \(\+\d+\.\d ms/step; "
                        r"steps \d+-\d+, confidence \d\.\d{5}\); evicting its node \(control.evict_stragglers\)",
                        fault.message), fault
    assert rec.restarts == 1 and roles(rec) == {"n0": "active", "n1": "evicted", "n2": "active", "n3": "spare"}
    assert rec.slot("n2").index == 1  # the spare holds n1's position: ranks 2 and 3

    final = wait(job.ended, 90, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 80 and final["restarts"] == 1, final
    assert [r["kind"] for r in final["recoveries"]] == ["straggler"], final["recoveries"]
    assert final["stragglers"] == [], final  # nobody is slow in incarnation 2
    log = events(job)
    assert "evicted n1 (straggler); n2 takes its place" in log and "recovered from straggler" in log
    findings = re.findall(r"event: straggler: rank (\d) on (n\d)", log)
    assert findings and set(findings) == {("2", "n1")}, findings  # no other rank was ever named

    step_s = float(os.environ["SIM_STEP_S"])

    def first_incarnation(rank: int) -> list[dict]:
        """The rank's own timings file up to the restart (incarnation 2 starts over from step 1)."""
        lines = Path(job.handle.run_dir, f"timings-rank{rank}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        restart = next(i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"])
        return records[:restart]

    def slowed(rank: int) -> float:  # its median compute from a second after the fault
        after = [r for r in first_incarnation(rank) if r["start"] > chaos_at + 1]
        return statistics.median(segment_value(r, "compute") for r in after)

    # The fault slows the named rank by about the factor asked, and no other.
    assert 2.0 * step_s < slowed(2) < 3.0 * step_s, slowed(2)
    assert all(slowed(rank) < 1.3 * step_s for rank in (0, 1, 3)), [slowed(rank) for rank in (0, 1, 3)]
    rows = [r for r in ParquetStore(Path(job.handle.run_dir) / "metrics").read("rd-slow") if r["incarnation"] == 2]
    assert {r["node"] for r in rows if r["rank"] in (2, 3)} == {"n2"}
    for rank in range(4):  # the spare computes at full speed
        assert statistics.median(segment_value(r, "compute") for r in rows if r["rank"] == rank) < 1.3 * step_s
    job.assert_services_gone()
