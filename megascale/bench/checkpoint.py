"""`megascale bench checkpoint`: how long a checkpoint blocks the training loop with two-phase
checkpointing vs synchronous torch.save vs torch.distributed.checkpoint.async_save, all saving
the same ZeRO state (fp32 master weights + two moments, >= 1 GiB over tp2 x dp2 ranks; --quick
~50 MB); then restore time and bytes read from storage with one reader per DP group vs every
rank reading every shard of its slice (and from host memory); then the time to restore the same
checkpoint resharded onto tp1 x pp2 x dp2 over the time to restore it onto its own layout."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megascale.checkpoint.checkpointer import Checkpointer
from megascale.checkpoint.client import shutdown_keeper
from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.parallel.tensor_parallel import shard_in_features, shard_out_features
from megascale.parallel.topology import ParallelContext
from megascale.parallel.zero import STATE_KEYS, DistributedOptimizer

CHECKPOINTS = 3  # per method; the median is reported
WEIGHTS, COLUMNS, SECTIONS = 8, 1024, 3  # stand-in weights: [rows, 1024], fused ones with 3 sections
RESHARD_ONTO = {"tp": 1, "pp": 2, "dp": 2}


class _Source:
    """The data-loader state a checkpoint carries (a step counter, as the synthetic source's)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def bench_job(uri: str, parallelism: dict) -> JobConfig:
    return from_dict({
        "name": "bench-checkpoint",
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 256, "seq": 32},
        "parallelism": parallelism,
        "checkpoint": {"uri": uri, "keeper_idle_s": 60},
    })


def _optimizer(ctx: ParallelContext, cfg: JobConfig, params: int) -> DistributedOptimizer:
    """A ZeRO optimizer over stand-in weights of `params` parameters in all (the state is what matters
    here, not the model), cut as the model's: alternately fused column-parallel (sections along dim 0,
    like q|k|v) and row-parallel (dim 1); `pp` stages hold consecutive ones. A weight's values depend
    only on its name and position, so any layout's optimizer starts with the state another layout's
    checkpoint restores to: master weights w, moments 2w and w^2."""
    rows = params // WEIGHTS // COLUMNS // 12 * 12  # whole sections for tp up to 4
    named = []
    for i in range(WEIGHTS):
        if i * ctx.layout.pp // WEIGHTS != ctx.pp.rank:
            continue
        full = (torch.arange(rows * COLUMNS, dtype=torch.float64).fmod(65521) + i).float().view(rows, COLUMNS)
        weight = shard_out_features(full, ctx.tp, [rows // SECTIONS] * SECTIONS) if i % 2 == 0 \
            else shard_in_features(full, ctx.tp)
        named.append((f"blocks.{i}.weight", weight))
    optimizer = DistributedOptimizer(named, ctx, cfg.optimizer, bucket_mb=64)
    optimizer.exp_avg.copy_(2 * optimizer.master)
    optimizer.exp_avg_sq.copy_(optimizer.master.square())
    return optimizer


def _timed_restore(ctx: ParallelContext, cfg: JobConfig, optimizer: DistributedOptimizer, parts: dict,
                   every_rank_reads: bool = False) -> dict:
    """Restores the newest checkpoint into `optimizer` (zeroed first) and checks it got its state back."""
    expected = [getattr(optimizer, key).clone() for key in STATE_KEYS]
    for key in STATE_KEYS:
        getattr(optimizer, key).zero_()
    checkpointer = Checkpointer(cfg, ctx, parts, every_rank_reads=every_rank_reads)
    dist.barrier()
    started = time.perf_counter()
    assert checkpointer.restore() == CHECKPOINTS
    seconds = _slowest(time.perf_counter() - started)
    assert all(torch.equal(getattr(optimizer, key), e) for key, e in zip(STATE_KEYS, expected))
    checkpointer.close()
    return {"seconds": seconds, "bytes_read": _total(checkpointer.bytes_read)}


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


def _bench_rank(ctx: ParallelContext, cfg: JobConfig, root: str, params: int) -> dict:
    optimizer = _optimizer(ctx, cfg, params)
    source = _Source()
    parts = {"optimizer": optimizer, "data": source}
    state_bytes = _total(sum(getattr(optimizer, k).numel() * 4 for k in STATE_KEYS))
    out: dict = {"state_bytes": state_bytes}

    # Two-phase: the stall is phase 1; phase 2 runs in the keeper between checkpoints.
    checkpointer = Checkpointer(cfg, ctx, parts)
    checkpointer.prepare()
    stalls, persists = [], []
    for k in range(1, CHECKPOINTS + 1):
        source.step = k
        dist.barrier()
        started = time.perf_counter()
        checkpointer.save(k)
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
                    "data": source.state_dict()}, os.path.join(path, f"rank{ctx.rank}.pt"))
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
    restores = {}
    for mode in ("host_memory", "one_reader_per_dp", "every_rank_reads"):
        if mode == "one_reader_per_dp":
            dist.barrier()
            if ctx.rank == 0:
                shutdown_keeper(cfg.checkpoint.uri)  # one keeper per node: the snapshots are gone
            dist.barrier()
        restores[mode] = _timed_restore(ctx, cfg, optimizer, parts, every_rank_reads=mode == "every_rank_reads")
    out["restore"] = restores
    return out


def _reshard_rank(ctx: ParallelContext, cfg: JobConfig, params: int) -> dict:
    """Restores the checkpoint onto this other layout (from storage, as one_reader_per_dp)."""
    optimizer = _optimizer(ctx, cfg, params)
    return _timed_restore(ctx, cfg, optimizer, {"optimizer": optimizer, "data": _Source()})


def run(args: argparse.Namespace) -> dict:
    # 12 bytes of state per parameter: 90M parameters = 1.006 GiB; --quick 4.4M = ~50 MB.
    params = 4_400_000 if args.quick else 90_000_000
    with tempfile.TemporaryDirectory(prefix="megascale-bench-ckpt-") as root:
        uri = os.path.join(root, "two_phase")
        cfg = bench_job(uri, {"tp": 2, "dp": 2})
        try:
            result = run_ranks(_bench_rank, layout_of(cfg), cfg, root, params)[0]
            shutdown_keeper(uri)  # from storage, as the same-layout restore it is compared with
            resharded = bench_job(uri, RESHARD_ONTO)
            reshard = run_ranks(_reshard_rank, layout_of(resharded), resharded, params)[0]
        finally:
            shutdown_keeper(uri)
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
        "reshard_layout": "tp2 x dp2 -> tp1 x pp2 x dp2",
        "reshard_restore_s": reshard["seconds"],
        "reshard_restore_bytes_read": int(reshard["bytes_read"]),
        "reshard_restore_s_ratio": reshard["seconds"] / restore["one_reader_per_dp"]["seconds"],
    }
