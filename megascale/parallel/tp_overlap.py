"""Sequence-parallel GEMMs with their communication pipelined (MegaScale §3.2).

The all-gather before a column-parallel GEMM and the reduce-scatter after a
row-parallel GEMM are split into chunks along the batch: while chunk i is being
multiplied, chunk i+1 is in flight — forward and backward. Numerically the same
as gather-then-GEMM and GEMM-then-reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megascale.parallel.comm import SEQ_DIM, InFlight
from megascale.parallel.topology import Group


class _Pending:
    """One chunk's collective in flight along the sequence dimension."""

    def __init__(self, x: torch.Tensor, group: Group, gather: bool):
        self.source = x.transpose(0, SEQ_DIM).contiguous()  # kept alive until the collective ends
        rows = self.source.shape[0] * group.size if gather else self.source.shape[0] // group.size
        self.out = self.source.new_empty((rows,) + tuple(self.source.shape[1:]))
        collective = dist.all_gather_single if gather else dist.reduce_scatter_single
        self.work = InFlight(collective(self.out, self.source, group=group.pg, async_op=True), group,
                             "all_gather" if gather else "reduce_scatter")

    def result(self) -> torch.Tensor:
        self.work.wait()
        return self.out.transpose(0, SEQ_DIM)


def _gathered_chunks(chunks: tuple[torch.Tensor, ...], group: Group):
    """Yields each chunk's all-gathered value while the next chunk's gather is in flight."""
    pending = _Pending(chunks[0], group, gather=True)
    for i in range(len(chunks)):
        full = pending.result()
        if i + 1 < len(chunks):
            pending = _Pending(chunks[i + 1], group, gather=True)
        yield full


class GatherThenLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T, the gather pipelined with the GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, num_chunks):
        gathered, outs = [], []
        for full in _gathered_chunks(x.chunk(num_chunks), group):
            gathered.append(full)
            outs.append(F.linear(full, weight))
        ctx.save_for_backward(torch.cat(gathered), weight)
        ctx.group, ctx.num_chunks = group, num_chunks
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        gathered, weight = ctx.saved_tensors
        grad_weight = torch.zeros_like(weight)
        scatters = []
        for go, full in zip(grad_out.chunk(ctx.num_chunks), gathered.chunk(ctx.num_chunks)):
            scatters.append(_Pending(go @ weight, ctx.group, gather=False))
            grad_weight.addmm_(go.flatten(0, 1).t(), full.flatten(0, 1))  # overlaps the reduce-scatter
        return torch.cat([s.result() for s in scatters]), grad_weight, None, None


class LinearThenReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(x @ W^T), the reduce-scatter pipelined with the GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, num_chunks):
        scatters = [_Pending(F.linear(chunk, weight), group, gather=False) for chunk in x.chunk(num_chunks)]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.num_chunks = group, num_chunks
        return torch.cat([s.result() for s in scatters])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_weight = torch.zeros_like(weight)
        grads = []
        for go_full, xc in zip(_gathered_chunks(grad_out.chunk(ctx.num_chunks), ctx.group), x.chunk(ctx.num_chunks)):
            grads.append(go_full @ weight)
            grad_weight.addmm_(go_full.flatten(0, 1).t(), xc.flatten(0, 1))
        return torch.cat(grads), grad_weight, None, None
