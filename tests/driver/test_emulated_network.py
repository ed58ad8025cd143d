"""`cluster.network: emulated`: each node in its own network namespace, linked to the others through a
bridge at `cluster.link_gbit` (megascale/common/netemu.py); network faults on them (chaos, self-checks, diagnose).

Building namespaces needs root and iproute2 (CI has both); those tests skip naming the reason otherwise.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import yaml

from megascale.cli import main
from megascale.common.processes import pid_alive
from megascale.config import from_dict
from megascale.common import netemu
from megascale.driver.state import JobState
from megascale.launch import run_ranks
from megascale.train import layout_of, train_rank

from control_plane_support import cli, events, launch  # noqa: E402 - tests/driver is on sys.path (conftest)

try:
    netemu.require_net_admin()
    WHY_NOT = ""
except netemu.NetworkError as e:
    WHY_NOT = str(e)
needs_net_admin = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)

MODEL = {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16}


def job_config(tmp_path: Path, name: str, steps: int, **cluster) -> dict:
    return {"name": name, "model": MODEL, "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2},
            "cluster": {"nodes": 2, **cluster},
            "control": {"heartbeat_s": 0.5, "dead_after_s": 8, "start_timeout_s": 90, "command_timeout_s": 30},
            "train": {"steps": steps, "run_dir": str(tmp_path / "runs")}}


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_without_root_emulated_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(netemu, "has_net_admin", lambda: False)
    config = write(tmp_path, job_config(tmp_path, "emu-noroot", 1, network="emulated"))
    assert main(["run", config, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megascale run: cluster.network: emulated needs root (CAP_NET_ADMIN)"


def test_link_latency_is_refused_because_it_is_not_emulated():
    with pytest.raises(Exception, match=r"^cluster.link_latency_ms=5.0: link delay is not emulated"):
        from_dict({"cluster": {"network": "emulated", "link_latency_ms": 5}})


def transfer_rate(server_ns: str | None, address: str, client_ns: str | None, nbytes: int = 6_000_000) -> float:
    """Bytes/s of one TCP stream from a socket made in `client_ns` to one listening in `server_ns`, from the
    first byte sent to the last received (a receiver scheduled late cannot shorten it)."""
    with netemu.inside(server_ns) if server_ns else nullcontext():
        server = socket.create_server((address, 0))
    with netemu.inside(client_ns) if client_ns else nullcontext():
        client = socket.socket()
    received = []

    def receive():
        conn, _ = server.accept()
        got = 0
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
        received.append((got, time.perf_counter()))
        conn.close()

    receiver = threading.Thread(target=receive)
    receiver.start()
    client.connect(server.getsockname())
    start = time.perf_counter()
    client.sendall(b"x" * nbytes)
    client.close()
    receiver.join(30)
    server.close()
    got, end = received[0]
    assert got == nbytes
    return got / (end - start)


@needs_net_admin
def test_the_link_rate_limits_traffic_between_nodes_but_not_inside_one():
    job = f"emu-rate-{os.getpid()}"
    net = netemu.create(job)
    try:
        a = netemu.add_node(net, "n0", 0.1)
        netemu.add_node(net, "n1", 0.1)
        across = transfer_rate(net.namespace("n0"), a, net.namespace("n1"))
        within = transfer_rate(net.namespace("n0"), a, net.namespace("n0"))  # its own address: over lo
        loopback = transfer_rate(None, "127.0.0.1", None)
        print(f"0.1 Gbit/s link: across {across / 1e6:.1f} MB/s, within a node {within / 1e6:.0f} MB/s, "
              f"host loopback {loopback / 1e6:.0f} MB/s")
        assert 5e6 < across < 15e6  # 0.1 Gbit/s = 12.5 MB/s; the first 256 KB pass at once (the bucket)
        assert within > 3 * across and loopback > 3 * across  # not capped by the link (noisy on a shared host)
    finally:
        netemu.teardown(job)
    assert netemu.leftovers(job) == []


def reference_losses(config: dict, run_dir: Path) -> list[float]:
    """The same job's losses with every rank on this host's loopback."""
    cfg = from_dict(config)
    run_dir.mkdir(parents=True)
    run_ranks(train_rank, layout_of(cfg), cfg, str(run_dir), backend="gloo")
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs_net_admin
@pytest.mark.slow
def test_an_emulated_job_trains_like_loopback_and_leaves_no_network_after_its_supervisor_is_killed(
        tmp_path, capsys, wait, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY")  # real GPT ranks
    config = job_config(tmp_path, "emu-e2e", 3, network="emulated", link_gbit=0.5)
    job = launch(capsys, write(tmp_path, config), "emu-e2e")
    wait(lambda: job.state() == JobState.RUNNING, 90, "the ranks to start")
    namespaces = {n: os.stat(f"/proc/{job.node_pid(n)}/ns/net").st_ino for n in ("n0", "n1")}
    assert len({*namespaces.values(), os.stat("/proc/self/ns/net").st_ino}) == 3, "nodes share a namespace"
    assert sorted(netemu.nodes("emu-e2e")) == ["n0", "n1"]

    os.kill(job.handle.supervisor_pid, signal.SIGKILL)  # its driver carries the job on, and tidies at the end
    expected = reference_losses(config, tmp_path / "loopback")
    final = wait(job.ended, 120, "the job to end under its driver")
    assert final["state"] == "Succeeded" and not pid_alive(job.handle.driver_pid)
    losses = [json.loads(line)["loss"] for line in Path(job.handle.run_dir, "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(expected, rel=1e-5)
    wait(lambda: netemu.leftovers("emu-e2e") == [], 10, "its namespaces, veths and bridge to go")
    assert not pid_alive(job.handle.redis_pid) and not pid_alive(job.handle.kafka_pid)



@needs_net_admin
@pytest.mark.slow
def test_a_slow_link_is_named_by_diagnose_and_a_downed_link_gets_its_node_evicted_by_its_self_check(
        tmp_path, capsys, wait, monkeypatch):
    monkeypatch.delenv("MEGASCALE_RANK_ENTRY")  # real GPT ranks: gloo traffic that a pulled cable cuts
    config = job_config(tmp_path, "emu-down", 100000, network="emulated")
    config["comm"] = {"timeout_s": 6}  # a collective waiting on a pulled cable fails after this
    config["control"]["selfcheck_budget_s"] = 20
    job = launch(capsys, write(tmp_path, config), "emu-down")
    wait(lambda: (job.status().get("step") or 0) >= 2, 60, "training progress")
    assert cli(capsys, "chaos", "emu-down", "slow-link", "--node", "n1", "--gbit", "0.05") == (
        "n1's link runs at 0.05 Gbit/s each way\n")

    # Each node's data link probed from its namespace to the bridge: n1's runs at a fiftieth of n0's.
    assert main(["diagnose", "--job", "emu-down", "--checks", "loopback", "--interfaces", "eth0", "--json",
                 "--set", "budgets.loopback=1"]) == 1
    report = json.loads(capsys.readouterr().out)
    link = {r["nodes"][0]: r for r in report["checks"] if r["metric"] == "link_bandwidth"}
    assert report["bad_nodes"] == ["n1"] and link["n1"]["status"] == "fail" and link["n0"]["status"] == "pass"
    assert link["n1"]["value"] < 0.0125 < link["n0"]["value"]  # GB/s: 0.05 Gbit/s is 6.25 MB/s

    # The control link stays up: n1 heartbeats on while its ranks' collectives time out; the self-check before
    # the restart probes each node's data link, and only n1's fails.
    assert cli(capsys, "chaos", "emu-down", "link-down", "--node", "n1") == "n1's link is down until the job ends\n"
    rec = wait(job.in_state(JobState.PAUSED), 90, "n1 to fail its self-check and be evicted (no spare: the job waits)")
    log = events(job)
    assert rec.slot("n1").role == "evicted" and not rec.slot("n1").dead, log
    assert "n0 passed its self-check: kept" in log and "loopback.link_bandwidth" in log, log
    assert "job emu-down stopped" in cli(capsys, "stop", "emu-down")
    assert netemu.leftovers("emu-down") == []
