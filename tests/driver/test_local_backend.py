"""The local backend signals only executors it started: a process record in Redis naming any other
process (forged, or written by someone without the job's key) gets nobody killed."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
import redis

from megascale.common.auth import SECRETS_ENV, JobSecrets
from megascale.driver.backend import NodeLaunch
from megascale.driver.chaos import ChaosError, inject
from megascale.driver.local import LocalBackend
from megascale.driver.state import JobRecord, JobStore, NodeSlot

KEY = "megascale:{j}:local"


@pytest.fixture
def backend(redis_server, tmp_path, monkeypatch):
    secrets = JobSecrets.generate()
    secrets.write(tmp_path / "j.secret")
    monkeypatch.setenv(SECRETS_ENV, str(tmp_path / "j.secret"))
    client = redis.Redis.from_url(redis_server.url)
    yield LocalBackend(NodeLaunch("j", redis_server.url, "127.0.0.1:1", str(tmp_path), 1.0), client), secrets
    client.close()


def record(proc: subprocess.Popen, node: str = "n0") -> bytes:
    return json.dumps({"node": node, "pid": proc.pid, "ctime": psutil.Process(proc.pid).create_time()}).encode()


def bystander(*argv: str) -> subprocess.Popen:
    """A process of this user that is no executor of the job unless its arguments say so."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_a_forged_process_record_gets_no_process_killed(backend):
    local, secrets = backend
    sleeper = bystander()
    lookalike = bystander("-m", "megascale.executor", "--job", "j", "--node", "n0")
    try:
        # Unsigned (whoever wrote it lacks the job's key), with the right pid and start time:
        local.r.hset(KEY, "n0", record(lookalike))
        # Signed, but naming a process that is not this node's executor:
        local.r.hset(KEY, "n1", secrets.signer().sign(record(sleeper, "n1")))
        assert {n: i.alive for n, i in local.list().items()} == {"n0": False, "n1": False}
        local.stop(["n0", "n1"], grace_s=0.5)
        local.evict("n1")
        assert sleeper.poll() is None and lookalike.poll() is None, "a process the driver did not start was killed"
        assert local.r.hget(KEY, "n1") is None and "n1" not in local.list()  # evicted: never looked up again

        # The same process with a record a component of the job signed is the node's: it is stopped.
        local.r.hset(KEY, "n0", secrets.signer().sign(record(lookalike)))
        assert local.list()["n0"].alive
        local.stop(["n0"], grace_s=5)
        assert lookalike.wait(timeout=5) is not None and sleeper.poll() is None
    finally:
        for proc in (sleeper, lookalike):
            proc.kill()
            proc.wait()


def test_chaos_signals_only_a_live_executor_of_the_job(backend):
    """`megascale chaos` finds its target as the driver does: not through a forged record, and not after the
    node's executor is gone (an evicted node stays listed), where it says so in one line."""
    local, secrets = backend
    store = JobStore(local.r, "j", secrets.signer())  # as the CLI's: JobStore.from_url with the job's secrets
    sleeper = bystander()
    executor = bystander("-m", "megascale.executor", "--job", "j", "--node", "n0")
    try:
        local.r.hset(KEY, "n1", record(sleeper, "n1"))  # unsigned, naming a bystander
        with pytest.raises(ChaosError, match="node n1 is not running"):
            inject(store, "kill-node", "n1")
        assert sleeper.poll() is None and store.last_chaos() is None

        local.r.hset(KEY, "n0", secrets.signer().sign(record(executor)))
        assert inject(store, "kill-node", "n0") == f"killed executor {executor.pid} of n0"
        assert executor.wait(timeout=5) == -9 and store.last_chaos()["node"] == "n0"
        with pytest.raises(ChaosError, match=r"node n0 is not running \(evicted or stopped\)"):
            inject(store, "freeze-node", "n0")
        with pytest.raises(ChaosError, match="has no local node 'n7'"):
            inject(store, "kill-node", "n7")
        store.submit(JobRecord("j", {}, "/r", nodes=[NodeSlot("n0", "active", 0), NodeSlot("n1", "evicted")]))
        local.evict("n1")  # its process record is dropped
        with pytest.raises(ChaosError, match="^node n1 of job j was evicted$"):
            inject(store, "kill-node", "n1")
    finally:
        for proc in (sleeper, executor):
            proc.kill()
            proc.wait()
