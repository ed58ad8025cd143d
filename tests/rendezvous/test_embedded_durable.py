"""An embedded Redis given a data directory (as `megascale run` gives it the job's) comes back from kill -9 on its
port with its keys and its login: a rendezvous store that was idle across the crash carries on, none the wiser."""
from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from megascale.rendezvous import redis_store
from megascale.common.embedded_redis import EmbeddedRedis
from megascale.rendezvous.redis_store import RedisStore


def test_kill_9_then_restart_keeps_keys_login_and_port(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_store, "IDLE_CHECK_S", 0.0)  # check the connection before every command
    server = EmbeddedRedis(username="job1", password="pw1", data_dir=tmp_path / "redis").start()
    try:
        store = RedisStore(port=server.port, job="durable", username="job1", password="pw1", connect_timeout=5)
        store.set("k", "v")
        time.sleep(1.1)  # appendfsync everysec: on disk from here on
        port, pid = server.port, server.pid
        server.restart()
        assert (server.port, server.alive()) == (port, True) and server.pid != pid
        assert store.get("k") == b"v" and store.add("n", 1) == 1  # the epoch came back too: not "restarted"
        with pytest.raises(redis.RedisError):  # still locked: no login, no access
            redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0)).get("k")
        store.close()
    finally:
        server.stop()
    assert any((tmp_path / "redis").iterdir())  # the job's log outlives the server; the private dir does not
