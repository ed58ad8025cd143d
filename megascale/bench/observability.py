"""`megascale bench timers`: what the always-on step timers cost a real Trainer step.

One process, one Trainer on one thread: steps alternate timers on / off in ABBA order
(on-off, off-on, ...) so drift cancels; the overhead is the median of the per-pair ratios minus
one. `overhead_fraction` compares the step's CPU time (the thread's own, so time the OS gave
the core to a neighbour does not count: a shared host otherwise swamps a 0.1% effect);
`overhead_fraction_wall` compares wall time. The span cost is also measured directly and
multiplied by the spans one step opens: `estimated_overhead_fraction`, free of noise.
"""
from __future__ import annotations

import argparse
import statistics
import time

GOAL = 0.01


def _config(quick: bool):
    from megascale.config import from_dict

    model = ({"layers": 2, "hidden": 64, "heads": 2, "ffn": 256, "vocab": 256, "seq": 32} if quick else
             {"layers": 4, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 1024, "seq": 64})
    return from_dict({"model": model, "batch": {"micro": 2, "global": 4}, "train": {"steps": 10_000, "gc_every": 0}})


def _span_cost_us(timer, n: int = 20_000) -> float:
    """Extra microseconds one span costs with timers on, over the same span with them off."""
    def loop() -> float:
        started = time.perf_counter()
        for _ in range(n):
            with timer.span("forward"):
                pass
        return time.perf_counter() - started

    was = timer.enabled
    try:
        timer.enabled = True
        on = min(loop() for _ in range(3))
        timer.enabled = False
        off = min(loop() for _ in range(3))
    finally:
        timer.enabled = was
        timer.collect()
    return max(0.0, (on - off) / n * 1e6)


def _spans_per_step(trainer) -> int:
    timer, calls = trainer.ctx.timer, [0]
    span, add = timer.span, timer.add

    def counting_span(segment):
        calls[0] += 1
        return span(segment)

    def counting_add(segment, seconds):
        calls[0] += 1
        add(segment, seconds)

    timer.span, timer.add = counting_span, counting_add
    try:
        trainer.step()
    finally:
        del timer.span, timer.add  # back to the class's methods
    return calls[0]


def run(args: argparse.Namespace) -> dict:
    import torch

    from megascale.parallel.topology import single_device_context
    from megascale.train import Trainer

    quick = bool(getattr(args, "quick", False))
    pairs = 15 if quick else 150
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: steps vary less on a shared host
    cfg = _config(quick)
    ctx = single_device_context()
    trainer = Trainer(cfg, ctx)
    try:
        for _ in range(3):  # warm-up: allocator, autograd graph caches
            trainer.step()
        ratios, wall_ratios, on, off = [], [], [], []
        for k in range(pairs):
            times = {}
            for enabled in ((True, False) if k % 2 == 0 else (False, True)):
                ctx.timer.enabled = enabled
                wall, cpu = time.perf_counter(), time.thread_time()
                trainer.step()
                times[enabled] = (time.perf_counter() - wall, time.thread_time() - cpu)
            on.append(times[True][0])
            off.append(times[False][0])
            wall_ratios.append(times[True][0] / times[False][0])
            ratios.append(times[True][1] / times[False][1])
        ctx.timer.enabled = True
        spans = _spans_per_step(trainer)
        span_us = _span_cost_us(ctx.timer)
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    step_off = statistics.median(off)
    estimated = spans * span_us * 1e-6 / step_off
    measured = statistics.median(ratios) - 1.0
    return {
        "overhead_fraction": round(measured, 5),
        "overhead_fraction_wall": round(statistics.median(wall_ratios) - 1.0, 5),
        "estimated_overhead_fraction": round(estimated, 6),
        "goal_fraction": GOAL,
        "meets_goal": measured <= GOAL,
        "step_time_on_s": round(statistics.median(on), 6),
        "step_time_off_s": round(step_off, 6),
        "pairs": pairs,
        "pair_ratio_iqr": [round(q, 4) for q in statistics.quantiles(ratios, n=4)[::2]],
        "pair_ratio_iqr_wall": [round(q, 4) for q in statistics.quantiles(wall_ratios, n=4)[::2]],
        "spans_per_step": spans,
        "span_cost_us": round(span_us, 3),
        "model": {k: getattr(cfg.model, k) for k in ("layers", "hidden", "seq", "vocab")},
        "quick": quick,
    }
