"""`megascale bench init`: time to rendezvous and create every parallel group.

Simulated ranks: each rank is one store client with its own connection; the ranks are
spread over several processes, as real ranks are. The clients connect first (timed apart:
see the TCPStore note), then all start together and each does exactly this store traffic
(`rank_calls`, one definition for every store):

  rendezvous   add(joined); the last arrival sets `complete`; wait(complete)
  default PG   communicator bootstrap: the root sets the id, every other rank gets it
  ordered      for each of its own groups (groups.group_specs order): the same bootstrap;
  ordered_barrier  ... plus torch's store barrier among the members after each
               (TORCH_DIST_INIT_BARRIER=1 with use_local_synchronization=True)
  naive        every rank walks *every* group in global order, bootstraps the ones it is
               in, and joins a world-wide store barrier after each
               (TORCH_DIST_INIT_BARRIER=1 without use_local_synchronization)

The bootstrap is NCCL's (one id per communicator; gloo instead swaps one key per member).
Naive costs one world-wide barrier per group, O(world x groups) store calls: at 1,024 and
2,048 ranks it would run for many minutes, so it runs over an evenly spread sample of the
groups, and the total is the time to the end of the first barrier plus the median gap between
consecutive barriers for each remaining group; the result says so (`extrapolated`).

Drivers. TCPStore ranks are threads: its C++ client holds no GIL while it waits. Redis
ranks are asyncio tasks sending RedisStore's exact commands (same scripts, same blocking
pops; a test checks the server sees identical traffic), because a thread per rank would
time Python's GIL rather than the store. `redis_threads` runs the real RedisStore on
threads for comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import NamedTuple

import redis
import torch.distributed as dist

from megascale.rendezvous import redis_store
from megascale.rendezvous.embedded import EmbeddedRedis
from megascale.rendezvous.groups import all_group_specs, create_groups, group_specs
from megascale.rendezvous.redis_store import RedisStore

LAYOUTS = {4: (2, 1, 2), 8: (2, 2, 2), 256: (8, 8, 4), 1024: (8, 16, 8), 2048: (8, 32, 8)}  # world: (tp, dp, pp)
TIMEOUT = timedelta(seconds=120)
NAIVE_SAMPLE = {256: 16, 1024: 12, 2048: 8}  # world-wide barriers actually timed, per world size
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
    tp, dp, pp = LAYOUTS[world]
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
    for spec in group_specs(tp, dp, pp, rank):
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
    groups = all_group_specs(*LAYOUTS[world])
    step = len(groups) / sample if sample else 0
    return [groups[int(i * step)] for i in range(sample)]


def _simulate(kind: str, world: int, plans: list[tuple[str, str, int | None]], nproc: int) -> dict:
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
        raise RuntimeError(f"benchmark worker failed: {msg[1]}")
    if msg[0] != what:
        raise RuntimeError(f"benchmark worker sent {msg[0]!r}, expected {what!r}")
    return msg


# -- a real start: gloo processes through init_method="redis://..." ---------------------------

def _rank_main(rank: int, world: int, url: str, timeout_s: float, local_sync, barrier, results) -> None:
    """One real rank: rendezvous, create the groups, two all-reduces, report group names."""
    import torch

    import megascale.rendezvous  # noqa: F401  registers redis://
    try:
        if barrier is not None:
            barrier.wait()
        start = time.time()
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        groups = create_groups(*LAYOUTS[world], local_sync=local_sync)
        total, tp_total = torch.ones(1), torch.ones(1)
        dist.all_reduce(total)
        if "tp" in groups:
            dist.all_reduce(tp_total, group=groups["tp"])
        end = time.time()
        names = [None] * world
        dist.all_gather_object(names, {kind: pg.group_name for kind, pg in groups.items()})
        results.put({"rank": rank, "start": start, "end": end, "world_sum": total.item(),
                     "tp_sum": tp_total.item(), "names": names})
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the parent reports it
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


class RealRanks(NamedTuple):
    procs: list
    results: mp.Queue
    start_line: object  # held so its semaphore outlives the children's unpickling


def launch_ranks(url: str, world: int, ranks: list[int] | None = None, timeout_s: float = 120.0,
                 start_line: bool = True, local_sync: bool | None = None) -> RealRanks:
    """Start real gloo ranks (all of `world` unless `ranks`) as processes; each puts one dict on `results`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megascale.rendezvous"])  # import torch once, not per rank
    ranks = list(range(world)) if ranks is None else ranks
    barrier = ctx.Barrier(len(ranks)) if start_line else None
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, url, timeout_s, local_sync, barrier, results))
             for r in ranks]
    for p in procs:
        p.start()
    return RealRanks(procs, results, barrier)


def check_real_results(rows: list[dict], world: int) -> None:
    """Raise unless every rank succeeded, sums are right and each group has one name on all members."""
    bad = [r for r in rows if "error" in r]
    if bad:
        raise RuntimeError(f"real start failed on rank {bad[0]['rank']}: {bad[0]['error']}")
    tp = LAYOUTS[world][0]
    for row in rows:
        if (row["world_sum"], row["tp_sum"]) != (float(world), float(tp)):
            raise RuntimeError(f"rank {row['rank']}: all_reduce gave {row['world_sum']}/{row['tp_sum']}, "
                               f"expected {world}/{tp}")
    names = rows[0]["names"]
    for rank in range(world):
        for spec in group_specs(*LAYOUTS[world], rank):
            seen = {names[m].get(spec.kind) for m in spec.ranks}
            if len(spec.ranks) > 1 and len(seen) != 1:
                raise RuntimeError(f"{spec.kind} group {spec.ranks} has different names on its members: {seen}")


def real_start(world: int = 8) -> dict:
    """Seconds from a common start line (after imports) until every real rank has rendezvoused,
    built its groups and finished two all-reduces; and the same including process start."""
    with EmbeddedRedis() as server:
        t0 = time.time()
        launched = launch_ranks(f"{server.url}/bench-real?incarnation=0", world)
        rows = [launched.results.get(timeout=TIMEOUT.total_seconds()) for _ in launched.procs]
        wall = time.time() - t0
        for p in launched.procs:
            p.join(timeout=30)
    check_real_results(rows, world)
    return {"seconds": round(max(r["end"] for r in rows) - min(r["start"] for r in rows), 3),
            "with_process_start_s": round(wall, 3)}


# -- the benchmark -----------------------------------------------------------------------------

MODES = ["ordered", "ordered_barrier", "naive"]
FULL_PLAN = [(kind, world, MODES) for world in (256, 1024, 2048) for kind in ("redis", "tcp")] + [
    ("redis_threads", 2048, ["ordered"])]  # the real RedisStore, a thread per rank: mostly GIL
# Quick: the 2,048-rank Redis numbers only. A TCPStore run can pay this sandbox's 10-30 s
# connect stall, which alone would break the 30 s budget.
QUICK_PLAN = [("redis", 2048, ["ordered", "naive"])]
QUICK_NAIVE_SAMPLE = 3
NPROC = 16  # processes the simulated ranks are spread over (fewer: more GIL contention per process)


def _measure(kind: str, world: int, modes: list[str], naive_sample: int) -> list[dict]:
    plans = [(mode, mode, naive_sample if mode == "naive" else None) for mode in modes]
    rows = [{"store": kind, "world": world, "mode": mode, "layout_tp_dp_pp": list(LAYOUTS[world])} for mode in modes]
    try:
        got = _simulate(kind, world, plans, NPROC)
    except Exception as e:  # noqa: BLE001 - one failed configuration must not sink the report
        for row in rows:
            row["error"] = _first_line(e)
        return rows
    total_groups = len(all_group_specs(*LAYOUTS[world]))
    for row in rows:
        mode = row["mode"]
        row.update(connect_s=got["connect_s"], client_cpu_s=got[f"{mode}_client_cpu_s"])
        if mode == "naive":
            # Until the first world barrier ends: rendezvous and all; then the median gap
            # between consecutive barriers stands for each of the remaining groups.
            marks = got["naive_marks"]
            gaps = [b - a for a, b in itertools.pairwise(marks)] or [marks[0]]
            per_group = statistics.median(gaps)
            row.update(seconds=round(marks[0] + per_group * (total_groups - 1), 2), extrapolated=True,
                       per_group_s=round(per_group, 4), measured_s=got["naive"], measured_groups=naive_sample,
                       total_groups=total_groups)
        else:
            row["seconds"] = got[mode]
    return rows


def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark and returns its JSON-able report (`args.quick`: < 30 s smoke size)."""
    quick = bool(getattr(args, "quick", False))
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    for kind, world, modes in QUICK_PLAN if quick else FULL_PLAN:
        rows += _measure(kind, world, modes, QUICK_NAIVE_SAMPLE if quick else NAIVE_SAMPLE[world])

    def seconds(kind: str, world: int, mode: str) -> float | None:
        found = [r.get("seconds") for r in rows if (r["store"], r["world"], r["mode"]) == (kind, world, mode)]
        return found[0] if found else None

    def ratio(world: int) -> float | None:
        redis_s, tcp_s = seconds("redis", world, "ordered"), seconds("tcp", world, "ordered")
        return round(redis_s / tcp_s, 2) if redis_s and tcp_s else None

    try:
        real = real_start(8)
    except Exception as e:  # noqa: BLE001 - reported in "errors"
        real = {"seconds": None, "error": _first_line(e)}
    ordered = seconds("redis", 2048, "ordered")
    return {
        "ordered_2048_s": ordered,
        "naive_2048_s": seconds("redis", 2048, "naive"),
        "redis_vs_tcp_1024": ratio(1024),
        "real_8proc_s": real["seconds"],
        "real_8proc_with_process_start_s": real.get("with_process_start_s"),
        "ordered_2048_tcp_s": seconds("tcp", 2048, "ordered"),
        "ordered_2048_redis_threads_s": seconds("redis_threads", 2048, "ordered"),
        "naive_2048_tcp_s": seconds("tcp", 2048, "naive"),
        "redis_vs_tcp_256": ratio(256),  # None in quick mode: no TCPStore run
        "redis_vs_tcp_2048": ratio(2048),
        "goal_ordered_2048_under_5s": None if ordered is None else ordered < 5.0,
        "quick": quick,
        "simulating_processes": NPROC,
        "cores": os.cpu_count(),
        "load_average_before_after": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "runs": rows,
        "errors": [f"{r['store']} {r['world']} {r['mode']}: {r['error']}" for r in rows if "error" in r]
                  + ([f"real start: {real['error']}"] if "error" in real else []),
        "notes": [
            ("seconds: from the common start line until the last simulated rank has rendezvoused and "
             "created its groups; connecting is timed apart (connect_s) because TCPStore connects in this "
             "sandbox stall 5-30 s on a reverse-DNS lookup, which is no fault of TCPStore"),
            ("Redis ranks run as asyncio tasks sending RedisStore's exact commands; TCPStore ranks as threads "
             "(its C++ client releases the GIL); redis_threads is the real RedisStore with a thread per rank, "
             "where Python's GIL, not the store, sets the pace"),
            f"all simulated ranks share {os.cpu_count()} cores with the store server; client_cpu_s is their CPU time",
            ("naive rows are extrapolated: time to the first world-wide barrier's end + (total_groups - 1) x "
             "per_group_s, the median gap between measured_groups consecutive barriers"),
        ],
    }
