"""The executor daemon against real Redis and a real tansu broker, with stand-in ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import redis

from megascale.config import from_dict
from megascale.driver.bus import TopicReader
from megascale.common.comm_env import DEFAULT_COMM_ENV, comm_env
from megascale.executor.ranks import classify
from megascale.common.messages import (Ack, Command, Heartbeat, Metric, Timings, acks_key, command_stream, decode,
                                       encode, topic)

def test_error_lines_are_classified():
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") == "oom"
    assert classify("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)") == "nccl_timeout"
    assert classify("RuntimeError: CUDA error: an illegal memory access was encountered") == "cuda_error"
    assert classify("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer") == "comm_error"
    assert classify("node1:1234 [0] NCCL WARN NET/IB : Got completion with error 12") == "comm_error"
    assert classify("ValueError: bad shape") == "python_exception"
    assert classify("[rank1]: megascale.data.DataError: data/x.jsonl: input not found") == "python_exception"
    assert classify("megascale.rendezvous.redis_store.RendezvousTimeout: Timeout after 300 s") == "comm_error"
    assert classify("step 4 loss 2.31") is None
    assert classify("  warnings.warn(msg)") is None


def test_hardware_errors_are_told_from_a_programs_own():
    """Evidence of a bad machine (the driver evicts the node unchecked; Kubernetes cordons the machine)."""
    for line in ("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
                 "[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
                 "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, An uncorrectable double bit error (DBE) has been detected",
                 "NVRM: Xid (PCI:0000:86:00): 94, pid=7, Contained: SM (0x1). RST: No, D-RST: No",
                 "NVRM: Xid (PCI:0000:3b:00): 63, pid=1, ECC page retirement or row remapping recording event",
                 "nvidia-smi: row remapping failure on GPU 3"):
        assert classify(line) == "hardware_error", line
    # A program's own faults, though the GPU reports them: the driver self-checks before it blames the node.
    assert classify("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception: ESR 0x405840") is None
    assert classify("NVRM: Xid (PCI:0000:3b:00): 31, pid=1, Ch 00000010, MMU Fault") is None
    assert classify("RuntimeError: CUDA error: an illegal memory access was encountered") == "cuda_error"
    # A failed ibv_ call may be the pod's configuration (memlock, no RDMA device) or the far end: no evidence.
    assert classify("node1:1234 [0] NCCL WARN Call to ibv_open_device failed") == "comm_error"
    assert classify("node1:1234 [0] NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory") != \
        "hardware_error"


def test_comm_env_layers_defaults_then_inherited_then_job():
    env = comm_env({"NCCL_IB_TIMEOUT": "23"}, inherited={"NCCL_IB_RETRY_CNT": "5"})
    assert env["NCCL_IB_TIMEOUT"] == "23"  # the job's config wins
    assert "NCCL_IB_RETRY_CNT" not in env  # the operator's environment beats our default
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == DEFAULT_COMM_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"]


def test_executor_runs_commands_and_heartbeats(redis_server, broker, tmp_path, wait, monkeypatch):
    monkeypatch.setenv("SIM_STEP_S", "0.1")
    monkeypatch.setenv("SIM_FAIL_AT", "0:2")  # rank 0 fails at step 2 of incarnation 1
    r = redis.Redis.from_url(redis_server.url)
    work = tmp_path / "n0"
    proc = subprocess.Popen([sys.executable, "-m", "megascale.executor", "--job", "j", "--node", "n0",
                             "--redis", redis_server.url, "--kafka", broker.bootstrap, "--work-dir", str(work),
                             "--heartbeat-s", "0.3"], stderr=open(tmp_path / "executor.log", "wb"))
    reader = TopicReader(broker.bootstrap, topic("j", "heartbeats"))
    beats: list[Heartbeat] = []
    seq = 0

    def send(op: str, **args) -> int:
        nonlocal seq
        seq += 1
        r.xadd(command_stream("j", "n0"), {"msg": encode(Command(job="j", node="n0", seq=seq, op=op, args=args))})
        return seq

    def acked(n: int):
        raw = r.hget(acks_key("j"), "n0")
        ack = decode(raw, expect=Ack) if raw else None
        return ack if ack and ack.seq >= n else None

    def beat(predicate):
        def check():
            beats.extend(decode(rec.value, expect=Heartbeat) for rec in reader.poll(100))
            return next((b for b in reversed(beats) if predicate(b)), None)
        return check

    def start(incarnation: int, steps: int) -> dict:
        cfg = from_dict({"parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2}, "train": {"steps": steps}})
        return dict(incarnation=incarnation, ranks=[0, 1], world_size=2, config=cfg.to_dict(),
                    run_dir=str(tmp_path), init_method="redis://unused/j", resume=False)

    try:
        idle = wait(beat(lambda b: b.phase == "idle"), 30, "an idle heartbeat")
        assert (idle.job, idle.node, idle.ranks) == ("j", "n0", [])
        assert idle.metrics.mem_used_bytes > 0

        r.xadd(command_stream("j", "n0"), {"msg": b"{not json"})  # logged and skipped
        n = send("start", **start(1, 5))
        assert wait(lambda: acked(n), 30, "start acknowledged").ok
        failed = wait(beat(lambda b: b.incarnation == 1 and any(x.state == "failed" for x in b.ranks)), 30,
                      "rank 0 failing")
        assert failed.ranks[0].exit_code == 1
        assert any(e.kind == "python_exception" and "injected failure" in e.line for e in failed.errors)

        n = send("start", **start(2, 5))
        wait(lambda: acked(n), 30, "second start acknowledged")
        n = send("start", **start(2, 5))  # the same incarnation again: a no-op, acknowledged
        assert "already started" in wait(lambda: acked(n), 30, "repeat acknowledged").detail
        done = wait(beat(lambda b: b.incarnation == 2 and [x.state for x in b.ranks] == ["succeeded"] * 2), 30,
                    "incarnation 2 to succeed")
        assert done.step == 5 and done.loss == 2.0 and done.errors == []

        n = send("start", **start(3, 1000))
        wait(beat(lambda b: b.incarnation == 3 and all(x.state == "running" for x in b.ranks)), 30, "ranks running")
        n = send("stop")
        assert wait(lambda: acked(n), 30, "stop acknowledged").ok
        wait(beat(lambda b: b.incarnation == 3 and all(x.state == "stopped" for x in b.ranks)), 10, "ranks stopped")

        n = send("diagnose", checks=["health"], budget_s=30)  # the real `megascale diagnose`, health only
        wait(beat(lambda b: b.phase == "diagnosing"), 20, "a diagnosing heartbeat")
        ack = wait(lambda: acked(n), 90, "diagnostics acknowledged")
        assert ack.ok and json.loads(ack.detail)["passed"] is True, ack.detail[-300:]

        # A recovery's stop loads a self-check worker; a start that no check of this node came before ends it.
        def workers() -> list[psutil.Process]:
            return [c for c in psutil.Process(proc.pid).children() if "megascale.diagnostics.worker" in c.cmdline()]
        n = send("stop", selfcheck=True)
        wait(lambda: acked(n), 30, "stop acknowledged")
        assert len(workers()) == 1
        n = send("start", **start(4, 1000))
        assert wait(lambda: acked(n), 30, "start acknowledged").ok
        assert workers() == []

        n = send("exit")
        assert proc.wait(timeout=30) == 0
        assert acked(n).detail == "exiting"
        wait(beat(lambda b: b.phase == "exiting"), 10, "a last heartbeat")
        assert [b.seq for b in beats if b.boot_id == idle.boot_id] == sorted({b.seq for b in beats})
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.close()
    log = (tmp_path / "executor.log").read_text()
    assert "ignored malformed command" in log

    metrics = TopicReader(broker.bootstrap, topic("j", "metrics"))
    try:
        seen: list = []  # the topic carries both kinds: a Metric from the reporting rank, Timings from every rank

        def both():
            seen.extend(decode(m.value) for m in metrics.poll(200))
            return {type(m) for m in seen} >= {Metric, Timings} and seen
        got = wait(both, 10, "metrics and timings")
        assert {m.rank for m in got if isinstance(m, Metric)} == {1}
        timings = [r for m in got if isinstance(m, Timings) for r in m.records]
        assert {r["rank"] for r in timings} >= {1} and all(r["incarnation"] >= 1 for r in timings)
    finally:
        metrics.close()


def test_a_step_older_than_hang_after_s_is_heartbeated_at_once(redis_server, broker, tmp_path, wait, monkeypatch):
    """The driver's hang clock reads the node's own age of its newest step; the heartbeat that says
    it passed control.hang_after_s goes out then, not a (here 30 s) heartbeat interval later."""
    monkeypatch.setenv("SIM_STEP_S", "0.1")
    monkeypatch.setenv("SIM_HANG_AT", "1:3")  # the reporting rank hangs after step 3
    r = redis.Redis.from_url(redis_server.url)
    proc = subprocess.Popen([sys.executable, "-m", "megascale.executor", "--job", "j", "--node", "n0",
                             "--redis", redis_server.url, "--kafka", broker.bootstrap,
                             "--work-dir", str(tmp_path / "n0"), "--heartbeat-s", "30"],
                            stderr=open(tmp_path / "executor.log", "wb"))
    reader = TopicReader(broker.bootstrap, topic("j", "heartbeats"))
    beats: list[Heartbeat] = []

    def stale_beat():
        beats.extend(decode(rec.value, expect=Heartbeat) for rec in reader.poll(100))
        return next((b for b in beats if b.step == 3 and (b.step_age_s or 0) >= 1.0), None)

    try:
        cfg = from_dict({"parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2}, "train": {"steps": 100},
                         "control": {"hang_after_s": 1.0}})
        start = dict(incarnation=1, ranks=[0, 1], world_size=2, config=cfg.to_dict(), run_dir=str(tmp_path),
                     init_method="redis://unused/j", resume=False)
        r.xadd(command_stream("j", "n0"), {"msg": encode(Command(job="j", node="n0", seq=1, op="start", args=start))})
        beat = wait(stale_beat, 20, "a heartbeat saying step 3 is older than hang_after_s")
        assert beat.step_age_s < 1.6, beat  # sent within a poll of crossing, by the node's clock
        assert beat.incarnation == 1 and all(x.state == "running" for x in beat.ranks)
    finally:
        proc.kill()
        proc.wait()
        reader.close()


def test_flight_records_come_only_from_ranks_whose_process_group_is_up_in_this_incarnation(tmp_path):
    """A rank still in its rendezvous has written nothing this incarnation: its recorder file is an earlier
    one's, and the driver's localisation would blame the operations it was in then. A rank process the OS
    shows stopped is named as such beside its records (it may have stopped inside the operation)."""
    from types import SimpleNamespace

    from megascale.executor.daemon import Executor
    from megascale.executor.ranks import RankProcess
    from megascale.parallel.flight_recorder import FlightRecorder

    recorder = FlightRecorder(tmp_path / "flight-rank0.bin")
    recorder.begin("all_reduce", "tp:0", 2)
    recorder.close()
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        procs = [RankProcess(rank, rank, child, tmp_path / "log", tmp_path / "progress", running=up)
                 for rank, up, child in ((0, True, children[0]), (1, False, children[1]))]
        executor = Executor.__new__(Executor)
        executor.group, executor.run_dir = SimpleNamespace(procs=procs), tmp_path
        assert "halted" not in json.loads(executor._flight({"last": 8})[1])
        for child in children:
            os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while "halted" not in json.loads(executor._flight({"last": 8})[1]) and time.time() < deadline:
            time.sleep(0.05)
        ok, detail = executor._flight({"last": 8})
    finally:
        for child in children:
            child.kill()
            child.wait()
    records = json.loads(detail)
    assert ok and [r["op"] for r in records["0"]] == ["all_reduce"]
    assert records["1"] == {"error": "rank 1 has no process group in this incarnation yet"}
    assert records["halted"] == {"0": "stopped"}  # rank 1 is in no operation of this incarnation


def test_heartbeats_travel_gzipped(redis_server, broker, tmp_path):
    """The broker keeps what it is sent (the embedded one in memory): heartbeats go compressed."""
    from megascale.executor.daemon import Executor

    executor = Executor("j", "n0", redis_server.url, broker.bootstrap, tmp_path)
    try:
        for _ in range(5):
            executor._heartbeat()
        executor._producer.flush(timeout=10)
        rate = executor._producer.metrics()["producer-metrics"]["compression-rate-avg"]
    finally:
        executor._producer.close(timeout=2)
        executor.timings.close()
    assert 0 < rate < 0.8  # compressed size / original size
