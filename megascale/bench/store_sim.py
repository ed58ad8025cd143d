"""Simulated ranks for `megascale bench init`: one store client per rank, with its own connection,
doing one rank's rendezvous and group-creation store traffic; the ranks are spread over several
processes, as real ranks are. The clients connect first (timed apart: TCPStore connects can stall
here), then all start together and each does exactly this store traffic (`rank_calls`, one
definition for every store):

  rendezvous   add(joined); the last arrival sets `complete`; wait(complete)
  default PG   communicator bootstrap: the root sets the id, every other rank gets it
  ordered      for each of its own groups (groups.group_specs order): the same bootstrap;
  ordered_barrier  ... plus torch's store barrier among the members after each
               (TORCH_DIST_INIT_BARRIER=1 with use_local_synchronization=True)
  naive        every rank walks *every* group in global order (or a sample of them), bootstraps the
               ones it is in, and joins a world-wide store barrier after each
               (TORCH_DIST_INIT_BARRIER=1 without use_local_synchronization)

The bootstrap is NCCL's (one id per communicator; gloo instead swaps one key per member).

Drivers. TCPStore ranks are threads: its C++ client holds no GIL while it waits. Redis
ranks are asyncio tasks sending RedisStore's exact commands (same scripts, same blocking
pops; a test checks the server sees identical traffic), because a thread per rank would
time Python's GIL rather than the store. `redis_threads` runs the real RedisStore on
threads for comparison.
"""
from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Callable, Generator
from datetime import timedelta

import redis
import torch.distributed as dist

from megascale.bench import BenchFailed
from megascale.parallel.topology import Layout
from megascale.rendezvous import redis_store
from megascale.common.embedded_redis import EmbeddedRedis
from megascale.rendezvous.groups import group_specs, world_group_specs
from megascale.rendezvous.redis_store import RedisStore

LAYOUTS = {4: Layout(tp=2, dp=1, pp=2), 8: Layout(tp=2, dp=2, pp=2), 256: Layout(tp=8, dp=8, pp=4),
           1024: Layout(tp=8, dp=16, pp=8), 2048: Layout(tp=8, dp=32, pp=8)}
TIMEOUT = timedelta(seconds=120)
BOOTSTRAP_ID = os.urandom(128)  # the size of an ncclUniqueId

# A store call: (method name, arguments); the generator receives each call's result. The one
# pseudo-call ("mark", (i,)) asks the driver to note when this rank finished naive barrier i.
Calls = Generator[tuple[str, tuple], object, None]


# -- the store traffic of one simulated rank ---------------------------------------------------

def _bootstrap(name: str, root: bool) -> Calls:
    if root:
        yield "set", (f"{name}/0", BOOTSTRAP_ID)
    else:
        yield "get", (f"{name}/0",)


def _store_barrier(key: str, size: int) -> Calls:
    """torch's _store_based_barrier, call for call."""
    yield "add", (key, 1)
    if (yield "add", (key, 0)) == size:
        yield "set", (f"{key}:last_worker", b"1")
    yield "wait", ([f"{key}:last_worker"],)


def _group_name(ranks: list[int]) -> str:
    return hashlib.sha1("_".join(map(str, ranks)).encode()).hexdigest()[:16]


def rank_calls(rank: int, world: int, mode: str, tag: str, naive_groups: list | None = None) -> Calls:
    """Every store call one rank makes to rendezvous and create its groups."""
    if (yield "add", (f"{tag}/rdzv/joined", 1)) == world:
        yield "set", (f"{tag}/rdzv/complete", b"1")
    yield "wait", ([f"{tag}/rdzv/complete"],)
    yield from _bootstrap(f"{tag}/default_pg", rank == 0)
    if mode == "naive":
        for i, spec in enumerate(naive_groups):
            if rank in spec.ranks:
                yield from _bootstrap(f"{tag}/{i}", rank == spec.ranks[0])
            yield from _store_barrier(f"{tag}/store_based_barrier_key:{i}", world)
            yield "mark", (i,)
        return
    for spec in group_specs(LAYOUTS[world], rank):
        name = f"{tag}/{spec.kind}/{_group_name(spec.ranks)}"
        yield from _bootstrap(name, rank == spec.ranks[0])
        if mode == "ordered_barrier":
            yield from _store_barrier(f"{name}/store_based_barrier_key", len(spec.ranks))


def run_calls(store, calls: Calls, marks: dict[int, list[float]] | None = None) -> None:
    """Drive `calls` against a blocking store (TCPStore, RedisStore)."""
    result = None
    try:
        while True:
            name, args = calls.send(result)
            if name == "mark":
                result = (marks if marks is not None else {}).setdefault(args[0], []).append(time.time())
            else:
                result = getattr(store, name)(*args)
    except StopIteration:
        pass


# -- RedisStore's protocol on asyncio, for the simulation only ----------------------------------

class AsyncRedisRank:
    """One rank's connection, sending exactly the commands RedisStore sends for add/set/get/wait."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, job: str) -> None:
        self.reader, self.writer = reader, writer
        self.ns = redis_store.namespace(job, 0)

    @classmethod
    async def connect(cls, host: str, port: int, job: str) -> AsyncRedisRank:
        rank = cls(*await asyncio.open_connection(host, port), job)
        await rank._call(("SETNX", rank.ns + redis_store.EPOCH, "sim"), ("GET", rank.ns + redis_store.EPOCH))
        return rank

    async def _call(self, *commands: tuple) -> list:
        self.writer.write(redis_store.pack(list(commands)))
        return [await self._reply() for _ in commands]

    async def _reply(self):
        line = await self.reader.readline()
        kind, body = line[:1], line[1:-2]
        if kind == b"$":
            n = int(body)
            return None if n < 0 else (await self.reader.readexactly(n + 2))[:-2]
        if kind == b":":
            return int(body)
        if kind == b"-":
            raise RuntimeError(body.decode())
        if kind == b"*":
            return [await self._reply() for _ in range(int(body))]
        return body

    def _k(self, key: str) -> str:
        return self.ns + redis_store.KEY_PREFIX + key

    async def _script(self, name: str, key: str, *args):
        sha = redis_store._SHA[name]
        return (await self._call(("EVALSHA", sha, 2, self.ns + redis_store.INDEX, self._k(key), *args)))[0]

    async def add(self, key: str, n: int) -> int:
        return int(await self._script("add", key, n))

    async def set(self, key: str, value: bytes) -> None:
        await self._script("set", key, value)

    async def get(self, key: str) -> bytes:
        while True:  # RedisStore._block_on, one slice at a time
            value = (await self._call(("BRPOPLPUSH", self._k(key), self._k(key), redis_store.BLOCK_SLICE_S)))[0]
            if value is not None:
                return value

    async def wait(self, keys: list[str]) -> None:
        if len(keys) != 1:
            found = await self._call(*[("EXISTS", self._k(k)) for k in keys])
            keys = [k for k, n in zip(keys, found) if not n]
        for key in keys:
            await self.get(key)


async def _run_calls_async(rank: AsyncRedisRank, calls: Calls, marks: dict[int, list[float]]) -> None:
    result = None
    try:
        while True:
            name, args = calls.send(result)
            if name == "mark":
                result = marks.setdefault(args[0], []).append(time.time())
            else:
                result = await getattr(rank, name)(*args)
    except StopIteration:
        pass


# -- simulation: worker processes, each holding a slice of the ranks ---------------------------

def _worker(kind, addr, world, ranks, plans, barrier, results) -> None:
    # TCPStore prints one warning per stalled connect (see the note); keep the report readable.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    # The store server has its own machine in production; here it shares 2 cores with every
    # simulated rank, so let it run first (the same for Redis and TCPStore).
    os.nice(10)
    try:
        if kind == "redis":
            asyncio.run(_async_worker(addr, world, ranks, plans, barrier, results))
        else:
            _thread_worker(kind, addr, world, ranks, plans, barrier, results)
    except Exception:  # noqa: BLE001 - the parent turns it into one line
        results.put(("error", traceback.format_exc().strip().splitlines()[-1]))


def _thread_worker(kind, addr, world, ranks, plans, barrier, results) -> None:
    host, port = addr

    def connect(rank: int) -> None:
        if kind == "tcp":
            clients[rank] = dist.TCPStore(host, port, None, False, TIMEOUT, wait_for_workers=False)
        else:
            clients[rank] = RedisStore(host, port, job="bench-sim", incarnation=0, timeout=TIMEOUT)

    clients: dict[int, dist.Store] = {}
    t0 = time.time()
    _in_threads(connect, ranks)
    if len(clients) != len(ranks):
        raise RuntimeError(f"{len(ranks) - len(clients)} {kind} clients failed to connect")
    results.put(("connected", time.time() - t0))
    for mode, tag, sample in plans:
        naive_groups = _sample_groups(world, sample)
        ends, errors, marks = [], [], {}
        go = threading.Event()

        def one(rank: int, go=go, mode=mode, tag=tag, naive_groups=naive_groups, ends=ends, errors=errors,
                marks=marks) -> None:
            go.wait()
            try:
                run_calls(clients[rank], rank_calls(rank, world, mode, tag, naive_groups), marks)
            except Exception as e:  # noqa: BLE001 - reported, not raised: the other ranks still finish
                errors.append(f"rank {rank}: {e}")
            ends.append(time.time())

        threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        barrier.wait()
        cpu = time.process_time()
        go.set()
        for t in threads:
            t.join()
        results.put(("done", max(ends), errors[:3], time.process_time() - cpu, _latest(marks)))


def _in_threads(fn: Callable[[int], None], ranks: list[int]) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def _async_worker(addr, world, ranks, plans, barrier, results) -> None:
    t0 = time.time()
    conns = dict(zip(ranks, await asyncio.gather(*[AsyncRedisRank.connect(*addr, "bench-sim") for _ in ranks])))
    results.put(("connected", time.time() - t0))
    for mode, tag, sample in plans:
        naive_groups = _sample_groups(world, sample)
        ends, errors, marks = [], [], {}

        async def one(rank: int, mode=mode, tag=tag, naive_groups=naive_groups, ends=ends, errors=errors,
                      marks=marks) -> None:
            try:
                await _run_calls_async(conns[rank], rank_calls(rank, world, mode, tag, naive_groups), marks)
            except Exception as e:  # noqa: BLE001 - reported, not raised: the other ranks still finish
                errors.append(f"rank {rank}: {e}")
            ends.append(time.time())

        barrier.wait()  # blocks the loop, which has nothing else to do
        cpu = time.process_time()
        await asyncio.gather(*[one(r) for r in ranks])
        results.put(("done", max(ends), errors[:3], time.process_time() - cpu, _latest(marks)))


def _latest(marks: dict[int, list[float]]) -> dict[int, float]:
    return {i: max(times) for i, times in marks.items()}


def _sample_groups(world: int, sample: int | None) -> list | None:
    if sample is None:
        return None
    groups = world_group_specs(LAYOUTS[world])
    step = len(groups) / sample if sample else 0
    return [groups[int(i * step)] for i in range(sample)]


def simulate(kind: str, world: int, plans: list[tuple[str, str, int | None]], nproc: int) -> dict:
    """Run `plans` (mode, key tag, naive sample) on one set of connected clients; seconds per tag."""
    server = master = None
    if kind == "tcp":
        master = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False, use_libuv=True)
        addr = ("127.0.0.1", master.port)
    else:
        server = EmbeddedRedis().start()
        addr = ("127.0.0.1", server.port)
        loader = redis.Redis(*addr)
        for source in redis_store.SCRIPTS.values():  # RedisStore loads them on first use; do it up front
            loader.script_load(source)
        loader.close()
    ctx = mp.get_context("fork")  # workers touch only stores, never a process group
    barrier, results = ctx.Barrier(nproc + 1), ctx.Queue()
    chunks = [list(range(world))[i::nproc] for i in range(nproc)]
    procs = [ctx.Process(target=_worker, args=(kind, addr, world, c, plans, barrier, results), daemon=True)
             for c in chunks]
    out: dict = {"connect_s": 0.0}
    try:
        for p in procs:
            p.start()
        connects = [_expect(results, "connected") for _ in procs]
        out["connect_s"] = round(max(c[1] for c in connects), 3)
        for mode, tag, sample in plans:
            barrier.wait(timeout=TIMEOUT.total_seconds())
            start = time.time()
            done = [_expect(results, "done") for _ in procs]
            errors = [e for d in done for e in d[2]]
            if errors:
                raise RuntimeError(f"{kind} {mode} at {world} ranks failed: {errors[0]}")
            out[tag] = round(max(d[1] for d in done) - start, 3)
            out[f"{tag}_client_cpu_s"] = round(sum(d[3] for d in done), 3)
            barriers = sorted({i for d in done for i in d[4]})  # when the last rank left each barrier
            out[f"{tag}_marks"] = [max(d[4].get(i, 0.0) for d in done) - start for i in barriers]
    finally:
        barrier.abort()  # frees workers still parked at the start line after a failure
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if server:
            server.stop()
    return out


def _expect(results, what: str):
    msg = results.get(timeout=TIMEOUT.total_seconds())
    if msg[0] == "error":
        raise BenchFailed(f"benchmark worker failed: {msg[1]}")
    if msg[0] != what:
        raise BenchFailed(f"benchmark worker sent {msg[0]!r}, expected {what!r}")
    return msg
