"""Runs a job's ranks as local processes: `run_ranks` for any per-rank function,
`launch_local` for training with a progress bar, logs and metrics in a run directory."""
from __future__ import annotations

import datetime
import json
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megascale.config import JobConfig, new_run_dir, with_run_dir
from megascale.lifetime import die_with_parent
from megascale.parallel.topology import Layout, ParallelContext, build_context

RankFn = Callable[..., Any]
log = logging.getLogger("megascale.launch")


def _device_for(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_backend(choice: str) -> str:
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return choice


def _rank_main(rank: int, layout: Layout, sequence_parallel: bool, backend: str, store_path: str,
               result_dir: str, timeout_s: float, parent_pid: int, fn: RankFn, args: tuple) -> None:
    # A launcher killed outright (SIGTERM, SIGKILL) takes its ranks with it, and their checkpoint
    # keeper, which serves this machine's ranks while that process lives (see checkpoint/keeper.py).
    die_with_parent(parent_pid)
    os.environ.setdefault("MEGASCALE_NODE_PID", str(parent_pid))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result_path = Path(result_dir) / f"rank{rank}.pt"
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))
        if layout.world_size > 1:
            store = dist.FileStore(store_path, layout.world_size)
            device = _device_for(backend, rank)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        else:
            device = _device_for(backend, rank)
        ctx = build_context(layout, rank, device, sequence_parallel)
        torch.save({"ok": True, "value": fn(ctx, *args)}, result_path)
    except BaseException as e:  # report every failure to the parent instead of dying silently
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(),
                    "at": time.time()}, result_path)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: RankFn, layout: Layout, *args: Any, sequence_parallel: bool = False, backend: str = "auto",
              timeout_s: float = 300.0) -> list[Any]:
    """Runs `fn(ctx, *args)` on every rank of `layout` in its own process; returns their results by rank.

    Raises RuntimeError naming the first failed rank.
    """
    backend = resolve_backend(backend)
    # fork is fast and needs no importable entry point; CUDA cannot survive a fork.
    context = mp.get_context("spawn" if backend == "nccl" else "fork")
    with tempfile.TemporaryDirectory(prefix="megascale-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [context.Process(target=_rank_main, daemon=False,
                                 args=(r, layout, sequence_parallel, backend, store_path, tmp, timeout_s,
                                       os.getpid(), fn, args))
                 for r in range(layout.world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks did not finish within {timeout_s:.0f}s")
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


def layout_of(cfg: JobConfig) -> Layout:
    p = cfg.parallelism
    return Layout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp)


def train_rank(ctx: ParallelContext, cfg: JobConfig, run_dir: str,
               on_step: Optional[Callable[[dict], None]] = None,
               on_start: Optional[Callable[[int], None]] = None,
               on_wait: Optional[Callable[[Optional[str]], None]] = None) -> list[dict]:
    """One rank's training loop. Every rank logs to rank-<R>.log (a line every train.log_every
    steps) and appends its step timings to timings-rank<R>.jsonl (the dashboard's heatmap); the
    reporting rank appends metrics.jsonl and calls `on_step(stats)`. `on_start(step)` learns the
    step training starts from (a restored checkpoint's, else 0); `on_wait(what)` what training is
    blocked on outside a step (a checkpoint persisting), then `on_wait(None)`."""
    from megascale.checkpoint import Checkpointer
    from megascale.parallel.flight_recorder import FlightRecorder
    from megascale.train import Trainer

    log_file = logging.FileHandler(Path(run_dir) / f"rank-{ctx.rank}.log")
    log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("megascale").addHandler(log_file)
    logging.getLogger("megascale").setLevel(logging.INFO)
    log.info("%s starting, %d steps", ctx.describe(), cfg.train.steps)
    ctx.attach_recorder(FlightRecorder(Path(run_dir) / f"flight-rank{ctx.rank}.bin"))
    trainer = Trainer(cfg, ctx)
    ckpt = cfg.checkpoint
    checkpointer = Checkpointer(cfg, ctx, trainer.optimizer) if ckpt.every or ckpt.resume else None
    if checkpointer:
        if on_wait is not None:
            checkpointer.on_wait = on_wait
        if ckpt.resume:
            checkpointer.restore(trainer)
        if ckpt.every:
            checkpointer.prepare()  # allocate the host buffer now, not in the first save
    if on_start is not None:
        on_start(trainer.step_index)
    reporter = ctx.tp.rank == 0 and ctx.dp.rank == 0 and ctx.is_last_stage
    history = []
    metrics = open(Path(run_dir) / "metrics.jsonl", "a") if reporter else None
    timings = open(Path(run_dir) / f"timings-rank{ctx.rank}.jsonl", "a")
    try:
        while trainer.step_index < cfg.train.steps:
            stats = asdict(trainer.step())
            history.append(stats)
            timings.write(json.dumps(stats["timings"]) + "\n")
            timings.flush()
            if stats["step"] % cfg.train.log_every == 0:
                log.info("step %d loss %.4f grad_norm %.3f lr %.3g %.3fs %.0f tok/s", stats["step"], stats["loss"],
                         stats["grad_norm"], stats["lr"], stats["step_time"], stats["tokens_per_s"])
            if reporter:
                metrics.write(json.dumps(stats) + "\n")
                metrics.flush()
                if on_step is not None:
                    on_step(stats)
            if checkpointer:
                checkpointer.after_step(trainer)
        if checkpointer:
            checkpointer.flush()  # the last checkpoint commits before the job reports success
        trainer.finish()
    finally:
        if checkpointer:
            checkpointer.close()
        trainer.close()
        timings.close()
        if metrics:
            metrics.close()
        logging.getLogger("megascale").removeHandler(log_file)
        log_file.close()
    return history


def launch_local(cfg: JobConfig, progress: bool = True) -> int:
    """Trains `cfg` on this machine, one process per rank; returns a process exit code."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    run_dir = new_run_dir(cfg, cfg.name)
    cfg = with_run_dir(cfg, run_dir)
    queue = mp.get_context("fork").SimpleQueue() if progress else None
    layout = layout_of(cfg)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(cfg.name, total=cfg.train.steps, status="starting")

        def follow() -> None:
            while True:
                stats = queue.get()
                if stats is None:
                    return
                bar.update(task, completed=stats["step"],
                           status=f"loss {stats['loss']:.4f}  {stats['tokens_per_s']:,.0f} tok/s")

        follower = threading.Thread(target=follow, daemon=True) if queue else None
        if follower:
            follower.start()
        try:
            run_ranks(train_rank, layout, cfg, str(run_dir), queue.put if queue else None,
                      sequence_parallel=cfg.parallelism.sequence_parallel, backend=cfg.parallelism.backend)
        finally:
            if cfg.checkpoint.uri:  # the job is over: nothing will restore from host memory
                from megascale.checkpoint import shutdown_keeper

                shutdown_keeper(cfg.checkpoint.uri)
            if queue:
                queue.put(None)
                follower.join(timeout=5)
    print(f"run directory: {run_dir}")
    return 0
