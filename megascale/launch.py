"""Runs a job's ranks as local processes: `run_ranks` for any per-rank function,
`launch_local` (`megascale train`) for training with a progress bar, logs and metrics in a run directory.

There is no deadline for the whole job: a rank blocked in a collective longer than `comm.timeout_s`
fails (the process group's timeout), and then its peers are stopped.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megascale.common.lifetime import die_with_parent
from megascale.config import CommConfig, JobConfig, new_run_dir, save_config, with_run_dir
from megascale.parallel.topology import Layout
from megascale.rank import init_rank, resolve_backend, shutdown_rank
from megascale.train import layout_of, train_rank

RankFn = Callable[..., Any]
RANKS_SCRATCH = ".ranks"  # in a run directory: the ranks' rendezvous file and results while they run


def _rank_main(rank: int, layout: Layout, init_method: str, comm: CommConfig, backend: str, sequence_parallel: bool,
               result_dir: str, flight_dir: Optional[str], parent_pid: int, place: Optional[Callable[[int], None]],
               fn: RankFn, args: tuple) -> None:
    # A launcher killed outright (SIGTERM, SIGKILL) takes its ranks with it, and their checkpoint
    # keeper, which serves this machine's ranks while that process lives (see checkpoint/keeper.py).
    die_with_parent(parent_pid)
    os.environ.setdefault("MEGASCALE_NODE_PID", str(parent_pid))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result_path = Path(result_dir) / f"rank{rank}.pt"
    try:
        if place is not None:
            place(rank)
        # A forked child of a process that has run OpenMP work hangs in its first multi-threaded
        # region (libgomp is not fork-safe; reproduced with torch's cos and matmul): forked ranks
        # run single-threaded, as torch's DataLoader workers do. Spawned ranks (NCCL) are not affected.
        threads = None if backend == "nccl" else 1  # run_ranks forks unless NCCL
        ctx = init_rank(layout, rank, init_method, comm, backend=backend, sequence_parallel=sequence_parallel,
                        flight_dir=flight_dir, threads=threads)
        torch.save({"ok": True, "value": fn(ctx, *args)}, result_path)
    except BaseException as e:  # report every failure to the parent instead of dying silently
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(),
                    "at": time.time()}, result_path)
        raise SystemExit(1)
    finally:
        shutdown_rank()


@contextlib.contextmanager
def _scratch(run_dir: Optional[str]):
    """A fresh folder for the ranks' rendezvous file and results, removed after them: `run_dir`/.ranks, or a
    temporary directory. In a run directory, a launcher killed outright (it runs no cleanup) leaves it there,
    not in /tmp, and its next launch in that directory replaces it."""
    if run_dir is None:
        with tempfile.TemporaryDirectory(prefix="megascale-ranks-") as tmp:
            yield tmp
        return
    path = Path(run_dir) / RANKS_SCRATCH
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_ranks(fn: RankFn, layout: Layout, *args: Any, sequence_parallel: bool = False, backend: str = "auto",
              comm: Optional[CommConfig] = None, flight_dir: Optional[str] = None,
              place: Optional[Callable[[int], None]] = None, run_dir: Optional[str] = None) -> list[Any]:
    """Runs `fn(ctx, *args)` on every rank of `layout` in its own process (started by `init_rank` with
    `comm`, the job's communication settings); returns their results by rank. `place(rank)` runs first in
    each rank's process (e.g. to enter its node's network namespace on an emulated network). The ranks meet
    in `run_dir` (see _scratch), or in a temporary directory.

    Waits as long as the ranks run. Raises RuntimeError naming the first failed rank.
    """
    comm = comm or CommConfig()
    backend = resolve_backend(backend)
    # fork is fast and needs no importable entry point; CUDA cannot survive a fork.
    context = mp.get_context("spawn" if backend == "nccl" else "fork")
    with _scratch(run_dir) as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs = [context.Process(target=_rank_main, daemon=False,
                                 args=(r, layout, init_method, comm, backend, sequence_parallel, tmp, flight_dir,
                                       os.getpid(), place, fn, args))
                 for r in range(layout.world_size)]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # one rank failed: its peers may be blocked in a collective
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        found = {}
        for rank in range(layout.world_size):
            path = Path(tmp) / f"rank{rank}.pt"
            if path.exists():
                found[rank] = torch.load(path, weights_only=False)
        failed = sorted((r["at"], rank) for rank, r in found.items() if not r["ok"])
        if failed:  # the earliest failure is the cause; its peers fail after it
            rank = failed[0][1]
            raise RuntimeError(f"rank {rank} failed: {found[rank]['error']}\n{found[rank]['trace']}")
        results = [r["value"] for _, r in sorted(found.items())]
        if len(results) != layout.world_size:
            codes = {r: p.exitcode for r, p in enumerate(procs)}
            raise RuntimeError(f"ranks exited without a result (exit codes {codes})")
        return results


def launch_local(cfg: JobConfig, progress: bool = True, run_dir: Optional[Path] = None) -> int:
    """Trains `cfg` on this machine, one process per rank, in a new run directory or in `run_dir` (a run
    going on: its config.yaml becomes `cfg`); returns a process exit code."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if run_dir is None:
        run_dir = new_run_dir(cfg, cfg.name)
        cfg = with_run_dir(cfg, run_dir)
    else:
        save_config(cfg, run_dir)
    queue = mp.get_context("fork").SimpleQueue() if progress else None
    layout = layout_of(cfg)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(cfg.name, total=cfg.train.steps, status="starting")

        def follow() -> None:
            validated = ""  # the newest validation stays shown until the next
            while True:
                stats = queue.get()
                if stats is None:
                    return
                if "val_loss" in stats:
                    validated = f"  val_loss {stats['val_loss']:.4f}"
                bar.update(task, completed=stats["step"],
                           status=f"loss {stats['loss']:.4f}{validated}  {stats['tokens_per_s']:,.0f} tok/s")

        follower = threading.Thread(target=follow, daemon=True) if queue else None
        if follower:
            follower.start()
        try:
            run_ranks(train_rank, layout, cfg, str(run_dir), queue.put if queue else None,
                      sequence_parallel=cfg.parallelism.sequence_parallel, backend=cfg.parallelism.backend,
                      comm=cfg.comm, flight_dir=str(run_dir), run_dir=str(run_dir))
        finally:
            if cfg.checkpoint.uri:  # the job is over: nothing will restore from host memory
                from megascale.checkpoint import shutdown_keeper

                shutdown_keeper(cfg.checkpoint.uri)
            if queue:
                queue.put(None)
                follower.join(timeout=5)
    print(f"run directory: {run_dir}")
    return 0
