"""A controlled pipeline run: chunks that take fixed forward/backward times, so the
measured idle time of the schedule can be compared with (p - 1) / (v * m)."""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from megascale.parallel.pipeline import run_schedule
from megascale.parallel.topology import ParallelContext


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedChunk(nn.Module):
    """Stands in for a model chunk: sleeps `forward_s` forward and `backward_s` backward."""

    def __init__(self, forward_s: float, backward_s: float, last: bool):
        super().__init__()
        self.forward_s, self.backward_s, self.last = forward_s, backward_s, last
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, labels=None) -> torch.Tensor:
        y = _Timed.apply(x * self.scale, self.forward_s, self.backward_s)
        return y.float().mean() if self.last else y


def measure_bubble(ctx: ParallelContext, microbatches: int, forward_s: float, backward_s: float) -> dict:
    """Runs one step of the real schedule over timed chunks; returns this rank's bubble fraction."""
    layout = ctx.layout
    last_virtual = layout.pp * layout.vpp - 1
    chunks = [TimedChunk(forward_s, backward_s, c * layout.pp + ctx.pp.rank == last_virtual)
              for c in range(layout.vpp)]
    shape = (1, 4)
    inputs = [torch.ones(shape) for _ in range(microbatches)]
    weights = [1.0 / microbatches] * microbatches
    run_schedule(chunks, ctx, inputs, [None] * microbatches, weights, shape, torch.float32)  # warm-up
    ctx.timer.enabled = True
    ctx.timer.collect()
    started = time.perf_counter()
    run_schedule(chunks, ctx, inputs, [None] * microbatches, weights, shape, torch.float32)
    elapsed = time.perf_counter() - started
    spans = ctx.timer.collect()
    compute = spans["forward"] + spans["backward"]  # what the sleeps really took on this machine
    return {"measured": (elapsed - compute) / compute,
            "formula": (layout.pp - 1) / (layout.vpp * microbatches)}
