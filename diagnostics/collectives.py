"""All-to-all and all-reduce timed across real torch.distributed processes (NCCL on GPU, gloo on CPU).

The parent hosts a TCPStore on 127.0.0.1 (free port), starts one process per rank and collects each
rank's timings from the store. A rank of a node on an emulated network (`netns`) enters that
namespace first and reaches the store at `store_host`, the root namespace's address on the bridge.
Every collective has a timeout and the parent kills ranks that outlive the run's deadline, so a hung
peer yields a failed result, never a hung suite.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field

from megascale.common.netemu import inside

_PRELOAD = ["torch", "torch.distributed", "megascale.diagnostics.collectives"]


@dataclass(frozen=True)
class RankSpec:
    node: str
    local_rank: int
    device: int
    delay_s: float = 0.0  # injected: sleep before each collective
    hang: bool = False  # injected: never reach the first collective
    netns: str | None = None  # the node's network namespace (an emulated network), entered before anything


@dataclass(frozen=True)
class _Job:
    op: str  # all_to_all | all_reduce
    ranks: tuple[RankSpec, ...]
    nbytes: int
    window_s: float
    timeout_s: float  # each collective
    startup_s: float  # for every rank to come up
    backend: str
    store_port: int
    latency: bool
    store_host: str


@dataclass
class CollectiveResult:
    ok: bool
    error: str = ""
    iter_s: float | None = None  # median over iterations of the slowest rank's iteration time
    latency_s: float | None = None  # same, for a 4-byte all-reduce
    waits_s: list[float] = field(default_factory=list)  # per rank: time spent inside collectives
    iterations: int = 0

    def bus_bandwidth(self, op: str, nbytes: int, world: int) -> float:
        """GB/s, nccl-tests convention: all-to-all moves (n-1)/n of the buffer, all-reduce 2(n-1)/n."""
        factor = (world - 1) / world * (2 if op == "all_reduce" else 1)
        return nbytes / self.iter_s * factor / 1e9

    def straggler(self) -> int | None:
        """Index of the rank that waited far less than its peers: everyone else waited for it."""
        if len(self.waits_s) < 2:
            return None
        low = min(range(len(self.waits_s)), key=self.waits_s.__getitem__)
        others = statistics.median(w for i, w in enumerate(self.waits_s) if i != low)
        return low if others > 4 * self.waits_s[low] and others - self.waits_s[low] > 0.001 else None


def run_collective(op: str, ranks: list[RankSpec], nbytes: int, budget_s: float, timeout_s: float,
                   backend: str, spawn_grace_s: float, latency: bool = False,
                   store_host: str = "127.0.0.1") -> CollectiveResult:
    """Time `op` over one process per RankSpec for about half of `budget_s`.

    Ranks get `spawn_grace_s` to start (process start-up is not the network's fault); from the
    moment all are up the run gets `budget_s`, and each collective `min(timeout_s, budget_s)`.
    """
    import torch.distributed as dist

    try:
        # Generous: c10d reverse-resolves socket addresses, and a slow DNS server stalls this for
        # seconds; nothing here waits on the store's timeout otherwise.
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=max(60, timeout_s)),
                              wait_for_workers=False)
    except RuntimeError as e:  # DistNetworkError and friends: a failed check, not a crashed suite
        return CollectiveResult(False, f"TCPStore on 127.0.0.1: {e}".splitlines()[0][:300])
    window = budget_s * (0.35 if latency else 0.5)
    job = _Job(op, tuple(ranks), nbytes, window, min(timeout_s, budget_s), spawn_grace_s, backend, store.port,
               latency, store_host)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # the fork server imports torch once for every run
    procs = [ctx.Process(target=_rank_main, args=(job, r), daemon=True, name=f"diag-{op}-{r}")
             for r in range(len(ranks))]
    for p in procs:
        p.start()
    results, up = [f"result/{r}" for r in range(len(ranks))], [f"up/{r}" for r in range(len(ranks))]
    deadline, started = time.monotonic() + spawn_grace_s, False
    first_error: float | None = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if not started and store.check(up):
            started, deadline = True, time.monotonic() + budget_s + 2.0
        # Once one rank has failed the rest get a short grace to report, then the run is over.
        if first_error is None and any(_is_error(store, k) for k in results):
            first_error = time.monotonic()
            deadline = min(deadline, first_error + 2.0)
        time.sleep(0.02)
    hung = _reap(procs)  # listed first below: a hung rank is the cause, its peers' timeouts the symptom
    late = [r for r, key in enumerate(up) if not store.check([key])]
    out = [json.loads(store.get(k)) if store.check([k]) else None for k in results]
    return _combine(job, out, hung, late)


def _is_error(store, key: str) -> bool:
    return store.check([key]) and "error" in json.loads(store.get(key))


def _reap(procs: list) -> list[int]:
    hung = []
    for r, p in enumerate(procs):
        if p.is_alive():
            hung.append(r)
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    return hung


def _combine(job: _Job, results: list[dict | None], hung: list[int], late: list[int]) -> CollectiveResult:
    problems = []
    for r in sorted(range(len(results)), key=lambda r: r not in hung):
        res = results[r]
        who = f"rank {r} (node {job.ranks[r].node}, local rank {job.ranks[r].local_rank})"
        if r in late:
            problems.append(f"{who} did not start within {job.startup_s:g} s")
        elif r in hung:
            problems.append(f"{who} hung and was killed")
        elif res is None:
            problems.append(f"{who} exited without a result")
        elif "error" in res:
            problems.append(f"{who}: {res['error']}")
    if problems:
        return CollectiveResult(False, "; ".join(problems)[:500])
    iters = [max(col) for col in zip(*(res["iter_s"] for res in results))]
    out = CollectiveResult(True, iter_s=statistics.median(iters), iterations=len(iters),
                           waits_s=[res["wait_s"] for res in results])
    if job.latency:
        out.latency_s = statistics.median(max(col) for col in zip(*(res["lat_s"] for res in results)))
    return out


def _rank_main(job: _Job, rank: int) -> None:
    spec = job.ranks[rank]
    if spec.netns is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every local-backend node is on this host
        _rank_body(job, rank, "127.0.0.1")
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the node's link to the others
    with inside(spec.netns):
        _rank_body(job, rank, job.store_host)


def _rank_body(job: _Job, rank: int, store_host: str) -> None:
    import torch
    import torch.distributed as dist

    spec = job.ranks[rank]
    timeout = datetime.timedelta(seconds=job.timeout_s)
    torch.set_num_threads(1)
    store = dist.TCPStore(store_host, job.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=job.startup_s))
    try:
        # Rendezvous on the store first, with the start-up allowance: a peer that is slow to
        # start must not eat into the collective timeout.
        store.set(f"up/{rank}", "1")
        store.wait([f"up/{r}" for r in range(len(job.ranks))])
        dist.init_process_group(job.backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=len(job.ranks), timeout=timeout)
        result = _measure(job, spec)
    except BaseException as e:  # noqa: BLE001 - report, then exit: the parent turns it into a failed check
        result = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    store.set(f"result/{rank}", json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(job: _Job, spec: RankSpec) -> dict:
    import torch
    import torch.distributed as dist

    if spec.hang:
        time.sleep(3600)  # injected fault: the parent must notice and kill us
    on_gpu = job.backend == "nccl"
    device = torch.device(f"cuda:{spec.device}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    world = len(job.ranks)
    numel = max(world, job.nbytes // 4 // world * world)  # all-to-all needs equal splits
    x = torch.ones(numel, device=device)
    out = torch.empty_like(x)
    big = (lambda: dist.all_to_all_single(out, x)) if job.op == "all_to_all" else (lambda: dist.all_reduce(x))
    iter_s, wait_s = _timed_loop(big, spec.delay_s, job.window_s, device, sync)
    result = {"iter_s": iter_s, "wait_s": wait_s}
    if job.latency:
        tiny = torch.zeros(1, device=device)
        result["lat_s"], _ = _timed_loop(lambda: dist.all_reduce(tiny), spec.delay_s, job.window_s * 0.4, device, sync)
    return result


def _timed_loop(op, delay_s: float, window_s: float, device, sync) -> tuple[list[float], float]:
    """Per-iteration times (including injected delay) and total time spent inside the collective."""
    import torch
    import torch.distributed as dist

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        t1 = time.perf_counter()
        op()
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    step()  # warm-up: connections and buffers
    # Every rank must run the same number of iterations, so they agree on the slowest estimate.
    estimate = torch.tensor([step()[0]], device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    iters = int(min(200, max(3, window_s / max(float(estimate), 1e-6))))
    times, wait = [], 0.0
    for _ in range(iters):
        took, inside = step()
        times.append(took)
        wait += inside
    return times, wait

