"""`megascale bench engine`: tokens/s and model-FLOPs utilisation against this machine's
GEMM peak measured in the same run (1 rank and tp=2; the llama arch at 1 rank), and the
PTB-vs-serial step-time ratio."""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.model.gpt import GPT
from megascale.parallel.topology import ParallelContext, single_device_context


def gemm_peak_flops(size: int, repeats: int = 5) -> float:
    """Best sustained fp32 matmul FLOP/s over a few square GEMMs (all cores)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - started))
    return best


def bench_job(block: str, tp: int, quick: bool, arch: str = "gpt") -> JobConfig:
    hidden = 256 if quick else 512
    # Llama's shape: SwiGLU at ~8/3 hidden (rounded up to 256, as Llama does) and 2 query heads per k/v head.
    llama = {"ffn": 256 * math.ceil(8 * hidden / 3 / 256), "kv_heads": 4}
    return from_dict({
        "name": f"bench-{arch}-{block}-tp{tp}",
        "model": {"layers": 2 if quick else 4, "hidden": hidden, "heads": 8, "ffn": 4 * hidden,
                  "vocab": 1024 if quick else 4096, "seq": 128 if quick else 256, "block": block, "arch": arch,
                  **(llama if arch == "llama" else {})},
        "parallelism": {"tp": tp},
        "batch": {"micro": 4, "global": 8 if quick else 16},
        "optimizer": {"name": "lamb"},
    })


def _time_steps(ctx: ParallelContext, cfg: JobConfig, steps: int) -> float:
    """Median step time after one warm-up step."""
    from megascale.train import Trainer

    trainer = Trainer(cfg, ctx)
    trainer.step()
    times = sorted(trainer.step().step_time for _ in range(steps))
    trainer.finish()
    trainer.close()
    return times[len(times) // 2]


def measure(cfg: JobConfig, steps: int) -> dict:
    tp = cfg.parallelism.tp
    if tp == 1:
        torch.set_num_threads(os.cpu_count() or 1)
        step_time = _time_steps(single_device_context(), cfg, steps)
    else:
        step_time = max(run_ranks(_time_steps, layout_of(cfg), cfg, steps))
    tokens = cfg.batch.global_ * cfg.model.seq
    with torch.device("meta"):  # the FLOP count needs the shapes only
        flops_per_token = GPT(cfg.model).num_flops_per_token()
    return {"step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "model_flops_per_s": tokens * flops_per_token / step_time}


def run(args: argparse.Namespace) -> dict:
    steps = 2 if args.quick else 4
    torch.set_num_threads(os.cpu_count() or 1)
    peak = gemm_peak_flops(512 if args.quick else 2048)
    results = {f"{block}_tp{tp}": measure(bench_job(block, tp, args.quick), steps)
               for tp in (1, 2) for block in ("serial", "parallel")}
    results["llama_serial_tp1"] = measure(bench_job("serial", 1, args.quick, arch="llama"), steps)
    cfg, llama = bench_job("serial", 1, args.quick).model, bench_job("serial", 1, args.quick, arch="llama").model
    return {
        "gemm_peak_flops": peak,
        "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "seq": cfg.seq, "vocab": cfg.vocab},
        "tokens_per_s": {name: r["tokens_per_s"] for name, r in results.items()},
        "model_llama": {"ffn": llama.ffn, "kv_heads": llama.kv_heads},
        "mfu_1rank": results["serial_tp1"]["model_flops_per_s"] / peak,
        "mfu_1rank_llama": results["llama_serial_tp1"]["model_flops_per_s"] / peak,
        "tokens_per_s_llama": results["llama_serial_tp1"]["tokens_per_s"],
        "mfu_tp2": results["serial_tp2"]["model_flops_per_s"] / peak,
        "ptb_speedup": results["serial_tp2"]["step_time_s"] / results["parallel_tp2"]["step_time_s"],
        "ptb_speedup_1rank": results["serial_tp1"]["step_time_s"] / results["parallel_tp1"]["step_time_s"],
        "step_time_s": {name: r["step_time_s"] for name, r in results.items()},
    }
