"""`megascale bench overlap`: step time and exposed communication per kind with
overlap off vs on, for tp2×pp2×dp2, tp=2 and dp=2, plus the measured pipeline bubble."""
from __future__ import annotations

import argparse
import statistics

from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.parallel.bubble import measure_bubble
from megascale.parallel.topology import Layout, ParallelContext
from megascale.timers import COMM_KINDS

LAYOUTS = {"tp2_pp2_dp2": {"tp": 2, "pp": 2, "dp": 2}, "tp2": {"tp": 2}, "dp2": {"dp": 2}}


def overlap_job(parallelism: dict, overlap: bool, quick: bool) -> JobConfig:
    return from_dict({
        "model": {"layers": 4, "hidden": 128 if quick else 256, "heads": 4, "ffn": 512 if quick else 1024,
                  "vocab": 1024, "seq": 64 if quick else 128},
        "parallelism": {**parallelism, "sequence_parallel": parallelism.get("tp", 1) > 1,
                        "overlap": {"tp": overlap, "pp": overlap, "dp": overlap}},
        "batch": {"micro": 4, "global": 16},
        "optimizer": {"name": "lamb"},
    })


def _rank_timings(ctx: ParallelContext, cfg: JobConfig, steps: int) -> dict:
    from megascale.train import Trainer

    trainer = Trainer(cfg, ctx)
    trainer.step()  # warm-up: gloo connections, allocator
    stats = [trainer.step() for _ in range(steps)]
    trainer.finish()
    trainer.close()
    segments = {k: statistics.mean(s.timings["segments"][k] for s in stats) for k in stats[0].timings["segments"]}
    return {"step_time": statistics.median(s.step_time for s in stats), "segments": segments}


def _measure(parallelism: dict, overlap: bool, quick: bool, steps: int) -> dict:
    cfg = overlap_job(parallelism, overlap, quick)
    ranks = run_ranks(_rank_timings, layout_of(cfg), cfg, steps, sequence_parallel=cfg.parallelism.sequence_parallel)
    exposed = {kind: statistics.mean(r["segments"][f"exposed_{kind}"] for r in ranks) for kind in COMM_KINDS}
    comm = {kind: statistics.mean(r["segments"][f"comm_{kind}"] for r in ranks) for kind in COMM_KINDS}
    return {"step_time_s": max(r["step_time"] for r in ranks), "exposed_s": exposed, "comm_s": comm}


def _reduction(on: float, off: float) -> float | None:
    return None if off <= 0 else 1 - on / off


def run(args: argparse.Namespace) -> dict:
    steps = 2 if args.quick else 4
    results = {name: {"off": _measure(p, False, args.quick, steps), "on": _measure(p, True, args.quick, steps)}
               for name, p in LAYOUTS.items()}
    main = results["tp2_pp2_dp2"]
    bubble = run_ranks(measure_bubble, Layout(pp=4, vpp=2), 8, 0.05, 0.1)
    return {
        "exposed_comm_reduction": {kind: _reduction(main["on"]["exposed_s"][kind], main["off"]["exposed_s"][kind])
                                   for kind in COMM_KINDS},
        "step_time_ratio_on_off": main["on"]["step_time_s"] / main["off"]["step_time_s"],
        "bubble_measured": max(r["measured"] for r in bubble),
        "bubble_formula": bubble[0]["formula"],
        "bubble_layout": "pp4 vpp2 m8, 50 ms forward / 100 ms backward per chunk",
        "layouts": results,
    }
