"""The local backend: each node is an executor process on this machine, in its own session.

Node pids live in Redis so a restarted driver (or `megascale stop` from another shell) can find
and stop nodes it did not start; (pid, start time) pairs guard against pid reuse. A record is
believed only if it carries the job's HMAC (when the job has a key) and names a live process whose
command line is this node's executor: whoever can write to Redis still cannot make the driver
signal a process it did not start.

With `cluster.network: emulated` each executor starts inside its node's network namespace
(`netemu`), which the backend creates before and removes after the node.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import redis

from megascale.common import netemu
from megascale.common.auth import BadRecord, Signer, env_signer
from megascale.common.processes import last_line

from . import log
from .backend import Backend, NodeInfo, NodeLaunch


class LocalBackend(Backend):
    def __init__(self, launch: NodeLaunch, client: redis.Redis):
        self.launch, self.r = launch, client
        self.key = f"megascale:{{{launch.job}}}:local"
        self._children: dict[str, subprocess.Popen] = {}
        self.signer = env_signer()
        self.net = netemu.JobNetwork(launch.job) if launch.network == "emulated" else None

    def work_dir(self, node: str) -> Path:
        return Path(self.launch.run_dir) / "nodes" / node

    def start(self, nodes: list[str]) -> None:
        for node in nodes:
            work = self.work_dir(node)
            work.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "megascale.executor", "--job", self.launch.job, "--node", node,
                    "--redis", self.launch.redis_url, "--kafka", self.launch.kafka, "--work-dir", str(work),
                    "--heartbeat-s", str(self.launch.heartbeat_s), "--standby", str(self.launch.standby),
                    "--ranks-per-node", str(self.launch.ranks_per_node)]
            env = {**os.environ, **self.launch.env}
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every "node" is on this host
            if self.net is not None:
                netemu.add_node(self.net, node, self.launch.link_gbit)
                argv = [*self.net.exec_prefix(node), *argv]
                env["GLOO_SOCKET_IFNAME"] = "eth0"  # the node's link; peers on the same node still meet on lo
            with open(work / "executor.log", "ab") as out:
                # Own session: a Ctrl-C at the terminal reaches `megascale run`, which stops nodes in order.
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
            self._children[node] = proc
            record = json.dumps({"node": node, "pid": proc.pid, "ctime": _ctime(proc.pid)}).encode()
            self.r.hset(self.key, node, self.signer.sign(record) if self.signer else record)
            log.info("started node %s (pid %d)", node, proc.pid)

    def _process(self, node: str, raw: Optional[bytes]) -> Optional[psutil.Process]:
        child = self._children.get(node)
        if child is not None:  # started by this process: its Popen is proof enough (even before its exec)
            try:
                return None if child.poll() is not None else psutil.Process(child.pid)
            except psutil.Error:
                return None
        return recorded_executor(self.launch.job, node, raw, self.signer)

    def list(self) -> dict[str, NodeInfo]:
        out = {}
        for node, raw in self.r.hgetall(self.key).items():
            node = node.decode()
            proc = self._process(node, raw)
            host = self.net.address(node) if self.net is not None else "127.0.0.1"
            out[node] = NodeInfo(node, proc is not None, host, f"pid {proc.pid}" if proc else "")
        return out

    def stop(self, nodes: list[str], grace_s: float = 10.0) -> None:
        records = self.r.hmget(self.key, nodes) if nodes else []
        procs = {n: p for n, raw in zip(nodes, records) if (p := self._process(n, raw)) is not None}
        for node, proc in procs.items():
            log.info("stopping node %s (pid %d)", node, proc.pid)
            _signal(proc, signal.SIGTERM)
            _signal(proc, signal.SIGCONT)  # a frozen executor (`chaos freeze-node`) must run to see it
        deadline = time.monotonic() + grace_s
        for node, proc in procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                log.warning("node %s ignored SIGTERM for %.0f s: killing it", node, grace_s)
                _signal(proc, signal.SIGKILL)
            except psutil.Error:
                pass
        for node in nodes:
            child = self._children.get(node)
            if child is not None:
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if self.net is not None:
                netemu.remove_node(self.net, node)

    def evict(self, node: str) -> None:
        """Stops the node for good (nothing to cordon on one machine; its id is never reused) and drops its process
        record, which `list` would otherwise look up every second for the rest of the job."""
        self.stop([node])
        self.r.hdel(self.key, node)
        self._children.pop(node, None)

    def exited_before_reporting(self, nodes: list[str]) -> Optional[str]:
        for node in nodes:
            child = self._children.get(node)
            if child is not None and child.poll() is not None:  # nothing restarts a node before it first reports
                return (f"node {node}'s executor exited with code {child.returncode} before it reported: "
                        f"{last_line(self.work_dir(node) / 'executor.log')}")
        return None

    def log_files(self, node: str) -> list[Path]:
        work = self.work_dir(node)
        ranks = sorted(work.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
        return [work / "executor.log", *ranks]


def recorded_executor(job: str, node: str, raw: Optional[bytes],
                      signer: Optional[Signer] = None) -> Optional[psutil.Process]:
    """The live executor of `node` that its process record `raw` names, if a component of this job wrote the
    record (`signer`: the job's HMAC, when it has a key) and the pid still belongs to that executor; else None
    (a bad record logged)."""
    if not raw:
        return None
    try:
        info = json.loads(signer.open(raw) if signer else raw)
        if info.get("node", node) != node or not isinstance(info.get("pid"), int):
            raise BadRecord("another node's record")
    except (BadRecord, ValueError, AttributeError) as e:
        log.warning("ignored the process record of node %s: %s", node, e)
        return None
    try:
        proc = psutil.Process(info["pid"])
        if info.get("ctime") is None or abs(proc.create_time() - info["ctime"]) > 0.5:
            return None  # the pid now belongs to someone else
        if proc.status() == psutil.STATUS_ZOMBIE or not _is_executor(proc.cmdline(), job, node):
            return None
        return proc
    except psutil.Error:
        return None


def _is_executor(cmdline: list[str], job: str, node: str) -> bool:
    """Whether a command line is the executor `start` runs for `node` of `job`."""
    def value(flag: str) -> Optional[str]:
        return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else None

    return "megascale.executor" in cmdline and value("--job") == job and value("--node") == node


def _ctime(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass
