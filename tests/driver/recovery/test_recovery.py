"""Automatic fault recovery end to end: real Redis, tansu, driver, executors and stand-in ranks
(driver/sim_rank.py: timed steps joined by a simulated all-reduce recorded in real flight
recorders, so a stopped rank stalls its peers like a real collective).

Faults are injected with `megascale chaos`, as a user would.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megascale.driver import crashpoints
from megascale.driver.state import JobState

from control_plane_support import cli, events, fast, launch


def test_kill_rank_then_kill_node_recover_automatically(tmp_path, capsys, wait):
    job = launch(capsys, fast(tmp_path, "rc-kill", steps=120), "rc-kill")
    wait(lambda: (job.status().get("step") or 0) >= 10, 60, "training progress")
    assert "killed rank process" in cli(capsys, "chaos", "rc-kill", "kill-rank", "--node", "n1")
    wait(job.in_state(JobState.RUNNING, incarnation=2), 30, "the automatic restart after a rank was killed")
    wait(lambda: len(job.status().get("recoveries", [])) == 1, 30, "the first recovery to complete")

    assert "killed executor" in cli(capsys, "chaos", "rc-kill", "kill-node", "--node", "n0")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=3), 40, "the dead node to be replaced by the spare")
    assert rec.restarts == 2 and rec.slot("n0").role == "evicted" and rec.slot("n2").role == "active"
    final = wait(job.ended, 90, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 120, final
    kinds = [r["kind"] for r in final["recoveries"]]
    assert kinds == ["rank_failed", "node_dead"], final["recoveries"]
    dead = final["recoveries"][1]
    assert dead["detection_s"] <= 1.0, dead  # the executor's exit, seen by the backend: within 2 heartbeat intervals
    assert all(r["total_s"] > 0 and r["steps_lost"] >= 0 for r in final["recoveries"])
    assert final["mttr_s"] > 0
    # ETTR counts every recovery's time as lost (and start-up besides); the status is written until the end.
    lost = sum(r["total_s"] for r in final["recoveries"])
    assert 0 < final["ettr"] <= 1 - (lost - 1.0) / (final["updated"] - rec.created), (final["ettr"], lost)
    log = events(job)
    assert "node n0: its executor exited" in log and "recovered from node_dead" in log
    assert "evicted n0 (dead (executor exited)); n2 takes its place" in log
    job.assert_services_gone()


def test_frozen_node_is_declared_dead_after_the_heartbeat_timeout(tmp_path, capsys, wait):
    job = launch(capsys, fast(tmp_path, "rc-freeze", steps=80), "rc-freeze")
    wait(lambda: (job.status().get("step") or 0) >= 5, 60, "training progress")
    assert "froze executor" in cli(capsys, "chaos", "rc-freeze", "freeze-node", "--node", "n1")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 40, "the silent node to be replaced by the spare")
    assert rec.slot("n1").role == "evicted" and rec.slot("n2").role == "active", rec.nodes
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 80, final
    (dead,) = final["recoveries"]
    # dead_after_s=3 from the last heartbeat, which came up to one interval (0.5 s) before the freeze
    assert dead["kind"] == "node_dead" and 2.4 <= dead["detection_s"] <= 5, dead
    assert "node n1: no heartbeat for 3." in events(job)
    job.assert_services_gone()


def test_no_spare_waits_paused_until_a_spare_is_added(tmp_path, capsys, wait):
    path = Path(fast(tmp_path, "rc-short", steps=60))
    path.write_text(path.read_text().replace("spares: 1", "spares: 0"))
    job = launch(capsys, str(path), "rc-short")
    wait(lambda: (job.status().get("step") or 0) >= 5, 60, "training progress")
    cli(capsys, "chaos", "rc-short", "kill-node", "--node", "n1")
    # the status the driver publishes, not its record: the status is written just after the record changes
    wait(lambda: job.status().get("state") == JobState.PAUSED.value, 30, "the job to wait for capacity")
    status = job.status()
    assert "waiting for capacity: 1 node(s) short and no spare left" in status["reason"], status
    assert "`megascale spares rc-short 1`" in status["reason"], status
    assert "keeps 1 spare(s) (has 0; starting 1 more)" in cli(capsys, "spares", "rc-short", "1")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 60, "the new spare to take n1's place")
    assert rec.slot("n1").role == "evicted" and rec.slot("n2").role == "active", rec.nodes
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["step"] == 60, final
    job.assert_services_gone()


def test_hang_is_localised_and_checked_before_the_restart_by_a_driver_killed_in_every_phase(tmp_path, capsys, wait,
                                                                                            monkeypatch):
    """The driver is kill -9ed (driver/crashpoints.py) while starting the first incarnation, while stopping the
    ranks (with one node sent the command and the other not), while self-checking the suspect (sent the command)
    and right after the eviction: every restarted driver resumes from the job record, and the recovery ends as
    one; the suspect's peer, checked beside the new ranks by a driver that restarted twice, is kept."""
    monkeypatch.setenv("MEGASCALE_DIAG_ALLOW_FAULTS", "1")  # executors honour injected self-check faults
    monkeypatch.setenv(crashpoints.ENV, "stop,diagnose,evict,start")
    job = launch(capsys, fast(tmp_path, "rc-hang", steps=100, selfcheck=True, selfcheck_budget_s=15), "rc-hang")
    wait(lambda: (job.status().get("step") or 0) >= 5, 60, "training progress")
    cli(capsys, "chaos", "rc-hang", "fail-selfcheck", "--node", "n0")
    cli(capsys, "chaos", "rc-hang", "hang", "--node", "n0", "--rank", "1")  # not the reporting rank
    # 4 driver restarts, each waiting for its predecessor's lease (3 s) to lapse
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 120, "the hang localised, checked, restarted")
    fault = rec.recovery.fault
    assert fault.kind == "hang" and fault.node == "n0", fault
    assert "[1] never entered" in fault.message, fault
    roles = {s.node: s.role for s in rec.nodes}
    assert roles["n0"] == "evicted" and roles["n1"] == "active" and roles["n2"] == "active", roles
    wait(lambda: "n1 passed its background self-check: kept" in events(job), 60, "n1's check beside the ranks")
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded", final
    log = events(job)
    # The suspect is checked before the restart, its peer beside the new ranks.
    assert "hang localised to n0" in log and "self-check of n0 (gemm); self-check of n1 beside the new ranks" in log
    assert log.count("evicted n0 (self-check failed: gemm.flops)") == 1
    crashed = [line.split("crash point ")[1].split()[0] for line in log.splitlines() if "crash point" in line]
    assert crashed == ["'start'", "'stop'", "'diagnose'", "'evict'"], crashed  # `start`: the first incarnation's
    assert final["restarts"] == 1 and len(final["recoveries"]) == 1, final
    job.assert_services_gone()


def test_crash_loop_fails_after_max_restarts(tmp_path, capsys, wait):
    job = launch(capsys, fast(tmp_path, "rc-loop", steps=2000, max_restarts=2), "rc-loop")
    wait(lambda: job.state() == JobState.RUNNING, 60, "the job to run")
    out = cli(capsys, "chaos", "rc-loop", "crash-loop", "--node", "n1")
    assert "3 rank(s) killed" in out and "job Failed" in out, out
    final = wait(job.ended, 30, "the job to end")
    assert final["state"] == "Failed" and "gave up after 2 restarts (control.max_restarts)" in final["reason"], final
    job.assert_services_gone()


@pytest.mark.slow
def test_killed_rank_restarts_at_once_and_its_node_failing_the_check_beside_it_is_evicted(tmp_path, capsys, wait,
                                                                                            monkeypatch):
    monkeypatch.setenv("MEGASCALE_DIAG_ALLOW_FAULTS", "1")  # executors honour injected self-check faults
    job = launch(capsys, fast(tmp_path, "rc-check", steps=150, selfcheck=True, selfcheck_budget_s=15), "rc-check")
    wait(lambda: (job.status().get("step") or 0) >= 5, 60, "training progress")
    cli(capsys, "chaos", "rc-check", "fail-selfcheck", "--node", "n1")
    cli(capsys, "chaos", "rc-check", "kill-rank", "--node", "n1")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=3), 90, "restart, the check beside it, eviction, restart")
    roles = {s.node: s.role for s in rec.nodes}
    assert roles["n0"] == "active" and roles["n1"] == "evicted" and roles["n2"] == "active", roles
    log = events(job)
    assert "restarting at once; self-check of n1 beside the new ranks (gemm)" in log
    assert "node n1 failed its self-check in the background (gemm.flops)" in log
    assert "evicted n1 (self-check failed: gemm.flops); n2 takes its place" in log
    assert "self-check of n0" not in log  # a node-local fault: its peers are not checked
    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["restarts"] == 1, final
    killed, failed_check = final["recoveries"]
    assert killed["kind"] == "rank_failed" and killed["diagnosis_s"] < 1.5, killed  # stop only: no check waited for
    assert failed_check["kind"] == "selfcheck_failed", failed_check
    job.assert_services_gone()


@pytest.mark.slow
def test_crashed_node_failing_its_check_once_is_checked_again_and_kept(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("MEGASCALE_DIAG_ALLOW_FAULTS", "1")
    job = launch(capsys, fast(tmp_path, "rc-retry", steps=2000, selfcheck=True, selfcheck_budget_s=15,
                              crashed_selfcheck="retry"), "rc-retry")  # stopped once checked twice
    wait(lambda: (job.status().get("step") or 0) >= 5, 60, "training progress")
    cli(capsys, "chaos", "rc-retry", "fail-selfcheck", "--node", "n1")  # its next check fails, the one after passes
    cli(capsys, "chaos", "rc-retry", "kill-rank", "--node", "n1")
    wait(lambda: "n1 passed its background self-check: kept" in events(job), 90, "two self-checks of n1")
    log = events(job)
    assert "background self-check failed on n1 (gemm.flops); checking once more" in log and "evicted" not in log
    assert job.state() == JobState.RUNNING and job.store.load().restarts == 1
    cli(capsys, "stop", "rc-retry")
    assert wait(job.ended, 60, "the job to stop")["state"] == "Stopped"
    job.assert_services_gone()
