"""`megascale run` / `launch` end to end: real Redis, real tansu, real driver/executor/rank processes.

All but the last use stand-in ranks (driver/sim_rank.py: steps on a timer, no torch),
so they test the control plane in seconds; the last trains the real GPT across two nodes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from kafka import KafkaAdminClient, KafkaProducer
from prometheus_client.parser import text_string_to_metric_families
from megascale.driver.metrics.store import ParquetStore
from megascale.common.processes import pid_alive
from megascale.driver.services import JobHandle
from megascale.driver.state import JobState, Phase


from control_plane_support import ROOT, Job, cli, job_yaml, launch  # noqa: E402 - tests/driver is on sys.path (conftest)


def test_launch_status_pause_resume_survive_driver_kill_stop(tmp_path, capsys, wait):
    job = launch(capsys, job_yaml(tmp_path, "cp-ops", steps=2000), "cp-ops")
    wait(lambda: job.state() == JobState.RUNNING and job.status().get("step"), 60, "training progress")
    listing = cli(capsys, "status")
    assert "cp-ops" in listing and "Running" in listing and "2/2 up" in listing
    detail = cli(capsys, "status", "cp-ops")
    assert all(n in detail for n in ("n0", "n1", "n2", "spare", "2 running"))

    assert "pause requested" in cli(capsys, "pause", "cp-ops")
    wait(job.in_state(JobState.PAUSED, reason="paused by user", phase=Phase.IDLE), 30, "the ranks to stop")
    # the record goes idle on the executors' acknowledgements; the nodes' phases shown come with their next heartbeats
    def ranks_shown_stopped():
        nodes = {n["node"]: n for n in job.status()["nodes"]}
        return nodes["n0"]["phase"] == "idle" and nodes["n1"]["ranks"] == {"stopped": 2}
    wait(ranks_shown_stopped, 10, "the nodes' heartbeats to show their ranks stopped")

    assert "resume requested" in cli(capsys, "resume", "cp-ops")
    wait(job.in_state(JobState.RUNNING, incarnation=2), 30, "incarnation 2 running")
    step = wait(lambda: job.status().get("step"), 30, "progress in incarnation 2")

    old_driver = job.refresh().driver_pid
    os.kill(old_driver, signal.SIGKILL)
    wait(lambda: job.refresh().driver_pid not in (None, old_driver), 30, "the supervisor to restart the driver")
    wait(lambda: job.status().get("driver", "").endswith(f":{job.handle.driver_pid}"), 30, "the new driver to lead")
    with open(f"/proc/{job.handle.driver_pid}/environ", "rb") as f:  # its Parquet work on a pool that returns pages
        assert b"ARROW_DEFAULT_MEMORY_POOL=jemalloc" in f.read().split(b"\0")
    wait(lambda: (job.status().get("step") or 0) >= step + 5, 30, "training to go on under the new driver")
    rec = job.store.load()
    assert (rec.state, rec.incarnation, rec.restarts) == (JobState.RUNNING, 2, 0)  # the ranks never noticed

    assert "job cp-ops stopped: stopped by user" in cli(capsys, "stop", "cp-ops")
    assert job.refresh().final["state"] == "Stopped"
    job.assert_services_gone()


def test_ctrl_c_on_run_stops_the_job_in_order_and_leaves_nothing_behind(tmp_path, wait):
    """A terminal's Ctrl-C reaches `megascale run`'s whole process group: the job ends Stopped (not
    Failed, no rank crash reported), exit code 130, every node, rank, driver and service gone."""
    config = job_yaml(tmp_path, "cp-ctrl-c", steps=100000)
    run = subprocess.Popen([sys.executable, "-m", "megascale.cli", "run", config, "--quiet"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        job = wait(lambda: JobHandle.load("cp-ctrl-c") and Job("cp-ctrl-c"), 60, "the job to be submitted")
        wait(lambda: job.state() == JobState.RUNNING and (job.status().get("step") or 0) >= 3, 60, "training")
        nodes = [job.node_pid(n) for n in ("n0", "n1", "n2")]
        os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, out[-2000:]
    final = job.refresh().final
    assert final["state"] == "Stopped" and final["reason"] == "stopped by user", final
    assert "Traceback" not in out and "Stopped" in out, out[-2000:]
    wait(lambda: not any(pid_alive(p) for p in nodes), 15, "the nodes to exit")
    job.assert_services_gone()


def test_a_killed_supervisor_leaves_a_job_that_still_answers_and_ends_cleanly(tmp_path, capsys, wait, monkeypatch):
    """SIGKILL (the OOM killer) of a launched job's supervisor: training goes on under its driver,
    `status` / `stop` still reach it, and its end stops the embedded services the supervisor started.
    Nothing of them stays in the temporary directory: the supervisor's Redis kept its ACL file there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the supervisor's, and so its Redis's
    job = launch(capsys, job_yaml(tmp_path, "cp-orphan", steps=100000), "cp-orphan")
    wait(lambda: job.state() == JobState.RUNNING and job.status().get("step"), 60, "training progress")
    os.kill(job.handle.supervisor_pid, signal.SIGKILL)
    wait(lambda: not pid_alive(job.handle.supervisor_pid), 10, "the supervisor to die")
    step = job.status()["step"]
    wait(lambda: (job.status().get("step") or 0) >= step + 3, 30, "training to go on without its supervisor")
    detail = cli(capsys, "status", "cp-orphan")
    assert "Running" in detail and "not running" not in detail and "the driver carries the job on" in detail
    assert "job cp-orphan stopped: stopped by user" in cli(capsys, "stop", "cp-orphan")
    assert job.refresh().final["state"] == "Stopped" and job.handle.driver_pid is None
    job.assert_services_gone()
    assert not list(tmp.glob("megascale-redis-*"))


def test_stop_cleans_up_after_a_job_whose_supervisor_and_driver_were_both_killed(tmp_path, capsys, wait):
    """Nobody is left to end it, but its nodes train on and its services serve: `stop` ends them all."""
    job = launch(capsys, job_yaml(tmp_path, "cp-headless", steps=100000), "cp-headless")
    wait(lambda: job.state() == JobState.RUNNING and job.status().get("step"), 60, "training progress")
    nodes = [job.node_pid(n) for n in ("n0", "n1", "n2")]
    os.kill(job.handle.supervisor_pid, signal.SIGKILL)
    os.kill(job.handle.driver_pid, signal.SIGKILL)
    wait(lambda: not job.refresh().live(), 10, "supervisor and driver to die")
    assert "cp-headless" in cli(capsys, "status") and all(pid_alive(p) for p in nodes)
    assert "`megascale stop cp-headless` stops what they left running" in cli(capsys, "status", "cp-headless")
    out = cli(capsys, "stop", "cp-headless")
    assert "had lost its supervisor and driver: stopped what they left (last state: Stopped)" in out, out
    assert "last state Running" in job.refresh().final["reason"]
    wait(lambda: not any(pid_alive(p) for p in nodes), 15, "the nodes to exit")
    job.assert_services_gone()


def test_broker_restart_and_junk_on_the_topics(tmp_path, capsys, wait):
    job = launch(capsys, job_yaml(tmp_path, "cp-bus", steps=50), "cp-bus")
    wait(lambda: job.state() == JobState.RUNNING and job.status().get("step"), 60, "training progress")
    junk = KafkaProducer(bootstrap_servers=job.handle.kafka, enable_idempotence=False)
    for value in (b"\x00garbage", b'{"v": 1, "kind": "heartbeat", "job": "cp-bus"}', b'{"v": 1, "kind": "ufo"}',
                  json.dumps({"v": 1, "kind": "heartbeat", "job": "other", "node": "n0"}).encode()):
        junk.send("cp-bus.heartbeats", key=b"n0", value=value)
    junk.flush()
    junk.close()
    # none of it carries the job's HMAC: dropped before it is even parsed
    wait(lambda: job.status().get("rejected", {}).get("unsigned", 0) >= 4, 20, "the driver to read past the junk")

    old_broker = job.handle.kafka_pid
    os.kill(old_broker, signal.SIGKILL)
    killed = time.time()
    wait(lambda: job.refresh().kafka_pid not in (None, old_broker), 20, "the supervisor to restart the broker")

    def fresh():
        nodes = [n for n in job.status()["nodes"] if n["role"] != "evicted"]
        return all((n["last_heartbeat"] or 0) > killed + 0.5 for n in nodes)
    wait(fresh, 30, "heartbeats from every node through the restarted broker")
    admin = KafkaAdminClient(bootstrap_servers=job.handle.kafka)
    try:  # only the driver writes events: nobody else re-creates their topic (its producer spun on it before)
        wait(lambda: "cp-bus.events" in admin.list_topics(), 10, "the driver to re-create its events topic")
    finally:
        admin.close()
    final = wait(job.ended, 90, "the job to end")
    assert final["state"] == "Succeeded" and final["restarts"] == 0, final
    log = Path(job.handle.run_dir, "driver.log").read_text()
    assert "Recovering" not in log and "dead" not in log  # no node was ever declared dead
    assert "ignored message cp-bus.heartbeats" in log and "not signed with the job's key" in log
    assert "was re-created" in log

    out = cli(capsys, "logs", "cp-bus", "--node", "n0")
    assert "[n0] " in out and "[n0/rank0] === incarnation 1" in out
    job.assert_services_gone()


@pytest.mark.slow
def test_failed_rank_restarts_dead_node_pauses_then_evict_and_resume(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("SIM_FAIL_AT", "1:3")  # rank 1 fails at step 3 of incarnation 1
    monkeypatch.setenv("SIM_STEP_S", "0.1")
    job = launch(capsys, job_yaml(tmp_path, "cp-fault", steps=60, dead_after_s=4, auto_recover=False), "cp-fault")
    rec = wait(job.in_state(JobState.RUNNING, incarnation=2), 90, "the automatic restart")
    assert rec.restarts == 1 and "injected failure at step 3" in rec.recovery.fault.message

    os.kill(job.node_pid("n1"), signal.SIGKILL)  # the node dies; its ranks die with it
    rec = wait(job.in_state(JobState.PAUSED), 30, "the dead node to pause the job")
    assert "node n1 is dead" in rec.reason and "megascale evict cp-fault n1" in rec.reason
    wait(lambda: job.store.load().phase == Phase.IDLE, 30, "the other ranks to stop")
    cli(capsys, "resume", "cp-fault")
    wait(lambda: job.store.load().reason.startswith("cannot resume: node n1 is dead"), 10, "resume to be refused")

    assert "spare n2 takes its place" in cli(capsys, "evict", "cp-fault", "n1")
    wait(job.in_state(JobState.RUNNING, incarnation=3), 30, "the job to resume with the spare")
    final = wait(job.ended, 90, "the job to end")
    assert final["state"] == "Succeeded", final
    roles = {n["node"]: n["role"] for n in final["nodes"]}
    assert roles == {"n0": "active", "n1": "evicted", "n2": "active", "n3": "spare"}
    job.assert_services_gone()


@pytest.mark.slow
def test_run_trains_gpt_across_two_nodes(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megascale.cli", "run", str(ROOT / "examples/gpt-nodes.yaml"),
                           "--steps", "4", "--run-dir", str(tmp_path / "runs"), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpt-nodes  Succeeded  step 4/4" in done.stdout
    handle = JobHandle.load("gpt-nodes")
    steps = [json.loads(line) for line in Path(handle.run_dir, "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["loss"] > 0 for s in steps)
    assert handle.final["loss"] == pytest.approx(steps[-1]["loss"])
    assert {n["node"]: n["ranks"] for n in handle.final["nodes"] if n["role"] == "active"} == {
        "n0": {"succeeded": 2}, "n1": {"succeeded": 2}}
    Job.assert_services_gone(type("J", (), {"handle": handle})())
    print(f"gpt-nodes: 2 nodes x 2 ranks + 1 spare, 4 steps in {time.monotonic() - started:.1f} s")


def test_timings_reach_the_store_stragglers_status_and_prometheus(tmp_path, capsys, wait, monkeypatch):
    monkeypatch.setenv("SIM_SLOW_RANK", "1")  # rank 1 computes 3x as long as its peers: a straggler on n0
    monkeypatch.setenv("SIM_STEP_S", "0.1")
    path = Path(job_yaml(tmp_path, "cp-timings", steps=40))
    # ~2 KB: the timings and progress files roll over every few steps (common/jsonl.py); the executor's tail
    # must ship every step exactly once across those rollovers
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "logging": {"jsonl_max_mb": 0.002}}))
    job = launch(capsys, str(path), "cp-timings")
    status = wait(lambda: job.status().get("stragglers") and job.status(), 60, "a straggler in the status")
    assert status["stragglers"][0].startswith("straggler: rank 1 on n0 ") and status["prometheus"]
    with urllib.request.urlopen(status["prometheus"], timeout=5) as reply:
        scraped = [s for family in text_string_to_metric_families(reply.read().decode()) for s in family.samples]
    assert any(s.name == "megascale_straggler_slowdown_ratio" and (s.labels["job"], s.labels["rank"], s.labels["node"])
               == ("cp-timings", "1", "n0") for s in scraped)
    assert any(s.name == "megascale_rank_step_seconds" for s in scraped)
    shown = cli(capsys, "status", "cp-timings")
    assert "straggler: rank 1 on n0" in shown and "ETTR" in shown and "recoveries 0" in shown

    final = wait(job.ended, 60, "the job to end")
    assert final["state"] == "Succeeded" and final["timings_stored"] == 4 * 40, final
    store = ParquetStore(Path(job.handle.run_dir) / "metrics")
    rows = store.read("cp-timings")
    assert len(rows) == 4 * 40 and {r["node"] for r in rows} == {"n0", "n1"}
    assert {r["incarnation"] for r in rows} == {1}
    timings = sorted(Path(job.handle.run_dir).glob("timings-rank*.jsonl"))
    assert len(timings) == 8 and all(p.stat().st_size < 2 * 2**20 * 0.002 for p in timings)  # 4 ranks, 2 parts
    assert store.read_status("cp-timings")["stragglers"]  # what `megascale dashboard` shows
    log = Path(job.handle.run_dir, "driver.log").read_text()
    assert "event: straggler: rank 1 on n0" in log
    job.assert_services_gone()
