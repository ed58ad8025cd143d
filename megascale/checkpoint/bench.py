"""`megascale bench checkpoint`: how long a checkpoint blocks the training loop with two-phase
checkpointing vs synchronous torch.save vs torch.distributed.checkpoint.async_save, all saving
the same ZeRO state (fp32 master weights + two moments, >= 1 GiB over tp2 x dp2 ranks; --quick
~50 MB); then restore time and bytes read from storage with one reader per DP group vs every
rank reading every shard of its slice (and from host memory)."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.checkpoint.checkpointer import STATE_KEYS, Checkpointer
from megascale.checkpoint.client import shutdown_keeper
from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.parallel.topology import ParallelContext
from megascale.parallel.zero import DistributedOptimizer

CHECKPOINTS = 3  # per method; the median is reported


class _Source:
    """The data-loader state a checkpoint carries (a step counter, as the synthetic source's)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def bench_job(uri: str, quick: bool) -> JobConfig:
    return from_dict({
        "name": "bench-checkpoint",
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 256, "seq": 32},
        "parallelism": {"tp": 2, "dp": 2},
        "checkpoint": {"uri": uri, "keeper_idle_s": 60},
    })


def _optimizer(ctx: ParallelContext, cfg: JobConfig, params_per_slice: int) -> DistributedOptimizer:
    """A ZeRO optimizer over stand-in parameters: the state is what matters here, not the model."""
    sizes = [params_per_slice // 8] * 8
    named = [(f"blocks.{i}.weight", nn.Parameter(torch.empty(n))) for i, n in enumerate(sizes)]
    optimizer = DistributedOptimizer(named, ctx, cfg.optimizer, bucket_mb=64)
    gen = torch.Generator().manual_seed(ctx.rank)
    for key in STATE_KEYS:
        getattr(optimizer, key).uniform_(generator=gen)
    return optimizer


def _slowest(seconds: float) -> float:
    """The loop is blocked until the slowest rank is back: the max over ranks."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _total(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _settle(ctx: ParallelContext, *drop: str) -> None:
    """Between measurements: delete what is no longer needed and write back dirty pages, so one
    method's writeback does not land in the next one's timing."""
    dist.barrier()
    if ctx.rank == 0:
        for path in drop:
            shutil.rmtree(path, ignore_errors=True)
        os.sync()
    dist.barrier()


def _bench_rank(ctx: ParallelContext, cfg: JobConfig, root: str, params_per_slice: int) -> dict:
    optimizer = _optimizer(ctx, cfg, params_per_slice)
    trainer = SimpleNamespace(optimizer=optimizer, source=_Source(), step_index=0)
    state_bytes = _total(sum(getattr(optimizer, k).numel() * 4 for k in STATE_KEYS))
    out: dict = {"state_bytes": state_bytes}

    # Two-phase: the stall is phase 1; phase 2 runs in the keeper between checkpoints.
    checkpointer = Checkpointer(cfg, ctx, optimizer)
    checkpointer.prepare()
    stalls, persists = [], []
    for k in range(1, CHECKPOINTS + 1):
        trainer.step_index = trainer.source.step = k
        dist.barrier()
        started = time.perf_counter()
        checkpointer.save(trainer)
        stalls.append(_slowest(time.perf_counter() - started))
        started = time.perf_counter()
        assert checkpointer.flush() == k
        persists.append(_slowest(time.perf_counter() - started))
    out["two_phase"] = {"stall_s": statistics.median(stalls), "persist_s": statistics.median(persists)}
    checkpointer.close()
    _settle(ctx)

    # Synchronous torch.save of the same tensors: the loop waits for the write.
    stalls = []
    for k in range(1, CHECKPOINTS + 1):
        path = os.path.join(root, "torch_save", f"step{k}")
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        started = time.perf_counter()
        torch.save({**{key: getattr(optimizer, key) for key in STATE_KEYS}, "rng": torch.get_rng_state(),
                    "data": trainer.source.state_dict()}, os.path.join(path, f"rank{ctx.rank}.pt"))
        stalls.append(_slowest(time.perf_counter() - started))
    out["sync_torch_save"] = {"stall_s": statistics.median(stalls)}
    _settle(ctx, os.path.join(root, "torch_save"))

    # DCP async_save: stages a copy, then writes from a thread. Keys are per rank: DCP would
    # otherwise treat the (different) plain tensors as replicated and save one copy.
    from torch.distributed.checkpoint import async_save

    stalls, persists = [], []
    state = {f"rank{ctx.rank}.{key}": getattr(optimizer, key) for key in STATE_KEYS}
    dcp_group = dist.new_group(backend="gloo")  # its writer thread's collectives must not mix with ours
    for k in range(1, CHECKPOINTS + 1):
        dist.barrier()
        started = time.perf_counter()
        future = async_save(state, checkpoint_id=os.path.join(root, "dcp", f"step{k}"), process_group=dcp_group)
        stalls.append(_slowest(time.perf_counter() - started))
        started = time.perf_counter()
        future.result()
        persists.append(_slowest(time.perf_counter() - started))
    out["dcp_async_save"] = {"stall_s": statistics.median(stalls), "persist_s": statistics.median(persists)}
    _settle(ctx, os.path.join(root, "dcp"))

    # Restores of the last two-phase checkpoint into a zeroed optimizer; each must give back the state.
    expected = [getattr(optimizer, key).clone() for key in STATE_KEYS]
    restores = {}
    for mode in ("host_memory", "one_reader_per_dp", "every_rank_reads"):
        if mode == "one_reader_per_dp":
            dist.barrier()
            if ctx.rank == 0:
                shutdown_keeper(cfg.checkpoint.uri)  # one keeper per node: the snapshots are gone
            dist.barrier()
        for key in STATE_KEYS:
            getattr(optimizer, key).zero_()
        checkpointer = Checkpointer(cfg, ctx, optimizer, every_rank_reads=mode == "every_rank_reads")
        dist.barrier()
        started = time.perf_counter()
        assert checkpointer.restore(trainer) == CHECKPOINTS
        seconds = _slowest(time.perf_counter() - started)
        assert all(torch.equal(getattr(optimizer, key), e) for key, e in zip(STATE_KEYS, expected)), mode
        restores[mode] = {"seconds": seconds, "bytes_read": _total(checkpointer.bytes_read)}
        checkpointer.close()
    out["restore"] = restores
    return out


def run(args: argparse.Namespace) -> dict:
    # 12 bytes of state per parameter: 90M parameters = 1.006 GiB; --quick 4.4M = ~50 MB.
    params_per_slice = 2_200_000 if args.quick else 45_000_000
    with tempfile.TemporaryDirectory(prefix="megascale-bench-ckpt-") as root:
        cfg = bench_job(os.path.join(root, "two_phase"), args.quick)
        try:
            result = run_ranks(_bench_rank, layout_of(cfg), cfg, root, params_per_slice)[0]
        finally:
            shutdown_keeper(cfg.checkpoint.uri)
    stall = {name: result[name]["stall_s"] for name in ("two_phase", "sync_torch_save", "dcp_async_save")}
    restore = result["restore"]
    return {
        "state_bytes": int(result["state_bytes"]),
        "layout": "tp2 x dp2 (4 ranks, one node)",
        "checkpoints_per_method": CHECKPOINTS,
        "stall_s": stall,
        "stall_ratio_vs_sync": stall["two_phase"] / stall["sync_torch_save"],
        "stall_ratio_vs_dcp_async": stall["two_phase"] / stall["dcp_async_save"],
        "background_persist_s": {"two_phase": result["two_phase"]["persist_s"],
                                 "dcp_async_save": result["dcp_async_save"]["persist_s"]},
        "restore_s": {mode: r["seconds"] for mode, r in restore.items()},
        "restore_bytes_read": {mode: int(r["bytes_read"]) for mode, r in restore.items()},
        "restore_bytes_ratio": restore["one_reader_per_dp"]["bytes_read"] / restore["every_rank_reads"]["bytes_read"],
        "restore_time_ratio": restore["one_reader_per_dp"]["seconds"] / restore["every_rank_reads"]["seconds"],
    }
