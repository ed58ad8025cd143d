"""`megascale bench init`: time to rendezvous and create every parallel group.

Simulated ranks: each rank is one store client (its own connection) driven by its own
thread, and the ranks are spread over several processes, as real ranks are. The clients
connect first (timed apart: see the TCPStore note), then all start together and each does
exactly this store traffic:

  rendezvous   add(joined); the last arrival sets `complete`; wait(complete)
  default PG   communicator bootstrap: the root sets the id, every other rank gets it
  ordered      for each of its own groups (groups.group_specs order): the same bootstrap;
               with barrier=True also torch's store barrier among the members
               (TORCH_DIST_INIT_BARRIER=1 with use_local_synchronization=True)
  naive        every rank walks *every* group in global order, bootstraps the ones it is
               in, and joins a world-wide store barrier after each
               (TORCH_DIST_INIT_BARRIER=1 without use_local_synchronization)

The bootstrap is NCCL's (one id per communicator; gloo instead swaps one key per member).
Naive costs one world-wide barrier per group, O(world x groups) store calls: at 1,024 and
2,048 ranks it would run for many minutes, so it is timed over an evenly spread sample of
the groups and scaled linearly (each group adds one identical barrier); the result says so.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from megascale.rendezvous.embedded import EmbeddedRedis
from megascale.rendezvous.groups import all_group_specs, create_groups, group_specs
from megascale.rendezvous.redis_store import RedisStore

LAYOUTS = {8: (2, 2, 2), 256: (8, 8, 4), 1024: (8, 16, 8), 2048: (8, 32, 8)}  # world: (tp, dp, pp)
TIMEOUT = timedelta(seconds=120)
NAIVE_SAMPLE = {256: 16, 1024: 8, 2048: 6}  # world-wide barriers actually timed
BOOTSTRAP_ID = os.urandom(128)  # the size of an ncclUniqueId


# -- the store traffic of one simulated rank ---------------------------------------------------

def _bootstrap(store: dist.Store, name: str, root: bool) -> None:
    if root:
        store.set(f"{name}/0", BOOTSTRAP_ID)
    else:
        store.get(f"{name}/0")


def _store_barrier(store: dist.Store, key: str, size: int) -> None:
    """torch's _store_based_barrier, call for call."""
    store.add(key, 1)
    if store.add(key, 0) == size:
        store.set(f"{key}:last_worker", "1")
    store.wait([f"{key}:last_worker"])


def _group_name(ranks: list[int]) -> str:
    return hashlib.sha1("_".join(map(str, ranks)).encode()).hexdigest()[:16]


def rank_traffic(store: dist.Store, rank: int, world: int, mode: str, tag: str,
                 naive_groups: list | None = None) -> None:
    """Everything one rank asks of the store to rendezvous and create its groups."""
    tp, dp, pp = LAYOUTS[world]
    if store.add(f"{tag}/rdzv/joined", 1) == world:
        store.set(f"{tag}/rdzv/complete", "1")
    store.wait([f"{tag}/rdzv/complete"])
    _bootstrap(store, f"{tag}/default_pg", rank == 0)
    if mode == "naive":
        for i, spec in enumerate(naive_groups):
            if rank in spec.ranks:
                _bootstrap(store, f"{tag}/{i}", rank == spec.ranks[0])
            _store_barrier(store, f"{tag}/store_based_barrier_key:{i}", world)
        return
    for spec in group_specs(tp, dp, pp, rank):
        name = f"{tag}/{spec.kind}/{_group_name(spec.ranks)}"
        _bootstrap(store, name, rank == spec.ranks[0])
        if mode == "ordered_barrier":
            _store_barrier(store, f"{name}/store_based_barrier_key", len(spec.ranks))


# -- simulation: worker processes full of rank threads ----------------------------------------

def _connect(kind: str, addr: tuple[str, int], tag: str) -> dist.Store:
    host, port = addr
    if kind == "tcp":
        return dist.TCPStore(host, port, None, False, TIMEOUT, wait_for_workers=False, use_libuv=True)
    return RedisStore(host, port, job=f"bench-{tag}", incarnation=0, timeout=TIMEOUT)


def _worker(kind, addr, world, ranks, plans, barrier, results) -> None:
    # TCPStore prints one warning per stalled connect (see the note); keep the report readable.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        clients: dict[int, dist.Store] = {}
        t0 = time.time()
        threads = [threading.Thread(target=lambda r=r: clients.__setitem__(r, _connect(kind, addr, "sim")))
                   for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(clients) != len(ranks):
            raise RuntimeError(f"{len(ranks) - len(clients)} {kind} clients failed to connect")
        results.put(("connected", time.time() - t0))
        for mode, tag, sample in plans:
            naive_groups = None if sample is None else _sample_groups(world, sample)
            ends, errors = [], []
            go = threading.Event()

            def one(rank: int) -> None:
                go.wait()
                try:
                    rank_traffic(clients[rank], rank, world, mode, tag, naive_groups)
                except Exception as e:  # reported, not raised: the other ranks still finish
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
            results.put(("done", max(ends), errors[:3], time.process_time() - cpu))
    except Exception:
        results.put(("error", traceback.format_exc().strip().splitlines()[-1]))


def _sample_groups(world: int, sample: int) -> list:
    groups = all_group_specs(*LAYOUTS[world])
    if not sample:
        return []
    step = len(groups) / sample
    return [groups[int(i * step)] for i in range(sample)]


def _simulate(kind: str, world: int, plans: list[tuple[str, str, int | None]], nproc: int) -> dict:
    """Run `plans` (mode, key tag, naive sample) on one set of connected clients; seconds per tag."""
    server = EmbeddedRedis().start() if kind == "redis" else None
    master = None
    if kind == "tcp":
        master = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False, use_libuv=True)
        addr = ("127.0.0.1", master.port)
    else:
        addr = ("127.0.0.1", server.port)
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


# -- a real start: 8 gloo processes through init_method="redis://..." -------------------------

def _real_rank(rank: int, world: int, url: str, barrier, results) -> None:
    import torch

    import megascale.rendezvous  # noqa: F401  registers redis://
    try:
        barrier.wait()
        start = time.time()
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world, timeout=TIMEOUT)
        groups = create_groups(*LAYOUTS[world])
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.all_reduce(x, group=groups["tp"])
        results.put((rank, start, time.time(), x.item()))
        dist.destroy_process_group()
    except Exception as e:
        results.put((rank, 0.0, 0.0, f"{type(e).__name__}: {e}"))


def real_start(world: int = 8) -> dict:
    """Start `world` gloo processes through redis://; seconds from the common start line to
    every rank having rendezvoused, built its groups and finished two all-reduces."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megascale.rendezvous"])  # import once, not per rank
    with EmbeddedRedis() as server:
        barrier, results = ctx.Barrier(world), ctx.Queue()
        url = f"{server.url}/bench-real?incarnation=0"
        t0 = time.time()
        procs = [ctx.Process(target=_real_rank, args=(r, world, url, barrier, results)) for r in range(world)]
        for p in procs:
            p.start()
        rows = [results.get(timeout=TIMEOUT.total_seconds()) for _ in procs]
        wall = time.time() - t0
        for p in procs:
            p.join(timeout=30)
    bad = [r for r in rows if not isinstance(r[3], float)]
    if bad:
        raise RuntimeError(f"real start failed on rank {bad[0][0]}: {bad[0][3]}")
    expected = float(world * (LAYOUTS[world][0]))  # sum of ones, then summed over tp
    if any(r[3] != expected for r in rows):
        raise RuntimeError(f"real start all_reduce gave {rows[0][3]}, expected {expected}")
    return {"seconds": round(max(r[2] for r in rows) - min(r[1] for r in rows), 3),
            "with_process_start_s": round(wall, 3)}


# -- the benchmark -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; `args.quick` keeps it to the 2,048-rank Redis numbers and a small TCP check."""
    quick = bool(getattr(args, "quick", False))
    nproc = 8
    table: list[dict] = []

    def measure(kind: str, world: int, modes: list[str]) -> dict:
        plans = [(mode, mode, NAIVE_SAMPLE[world] if mode == "naive" else None) for mode in modes]
        if "naive" in modes:  # naive's fixed part: rendezvous and the default PG, no groups
            plans.append(("naive", "naive_base", 0))
        got = _simulate(kind, world, plans, nproc)
        total_groups = len(all_group_specs(*LAYOUTS[world]))
        for mode in modes:
            row = {"store": kind, "world": world, "mode": mode, "connect_s": got["connect_s"]}
            if mode == "naive":
                base = got["naive_base"]
                per_group = max(got["naive"] - base, 0.0) / NAIVE_SAMPLE[world]
                row.update(seconds=round(base + per_group * total_groups, 2), measured_groups=NAIVE_SAMPLE[world],
                           total_groups=total_groups, extrapolated=True, measured_s=got["naive"])
            else:
                row["seconds"] = got[mode]
            table.append(row)
        return {r["mode"]: r["seconds"] for r in table if r["store"] == kind and r["world"] == world}

    worlds = [2048] if quick else [256, 1024, 2048]
    redis_s, tcp_s = {}, {}
    for world in worlds:
        modes = ["ordered", "naive"] if quick else ["ordered", "ordered_barrier", "naive"]
        redis_s[world] = measure("redis", world, modes)
        if not quick or world == 2048:
            tcp_s[world] = measure("tcp", world, ["ordered"] if quick else modes)
    ratio_world = 2048 if quick else 1024
    real = real_start(8)
    result = {
        "ordered_2048_s": redis_s[2048]["ordered"],
        "naive_2048_s": redis_s[2048]["naive"],
        "redis_vs_tcp_1024": round(redis_s[ratio_world]["ordered"] / tcp_s[ratio_world]["ordered"], 2),
        "real_8proc_s": real["seconds"],
        "real_8proc_with_process_start_s": real["with_process_start_s"],
        "ordered_2048_tcp_s": tcp_s[2048]["ordered"],
        "goal_ordered_2048_under_5s": redis_s[2048]["ordered"] < 5.0,
        "quick": quick,
        "simulated_processes": nproc,
        "runs": table,
        "notes": [
            "seconds exclude connecting; connect_s is reported apart because TCPStore connects here "
            "stall 5 s at random (a reverse-DNS quirk of this sandbox, not of TCPStore)",
            "naive rows are extrapolated from measured_groups world-wide barriers (see bench.py)",
        ],
    }
    if quick:
        result["notes"].append("quick: redis_vs_tcp_1024 is measured at 2,048 ranks; only 2,048 is run")
    return result
