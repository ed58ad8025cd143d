"""Differentiable tensor-parallel collectives (the conjugate pairs of Megatron-LM).

| function          | forward                 | backward                |
|-------------------|-------------------------|-------------------------|
| copy_to_tp        | identity                | all-reduce              |
| reduce_from_tp    | all-reduce              | identity                |
| gather_seq        | all-gather on seq dim   | reduce-scatter on seq   |
| reduce_scatter_seq| reduce-scatter on seq   | all-gather on seq       |

Activations are `[batch, seq, hidden]`; the sequence dimension is 1.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megascale.parallel.topology import Group

SEQ_DIM = 1


@contextmanager
def blocking(group: Group, op: str) -> Iterator[None]:
    """A synchronous collective: all of its time is exposed."""
    slot = group.recorder.begin(op, group.name, group.size) if group.recorder else None
    with group.timer.span(f"comm_{group.kind}"), group.timer.span(f"exposed_{group.kind}"):
        yield
    if slot is not None:
        group.recorder.end(slot)


class InFlight:
    """An async collective or P2P: in flight from issue to completion; exposed while waited on."""

    def __init__(self, work: Optional[dist.Work], group: Group, op: str, peer: int = -1):
        self.work, self.group = work, group
        group.timer.issued(group.kind)
        self.slot = group.recorder.begin(op, group.name, group.size, peer) if group.recorder else None

    def wait(self) -> None:
        if self.work is None:
            return
        blocked = time.perf_counter()
        self.work.wait()
        self.group.timer.add(f"exposed_{self.group.kind}", time.perf_counter() - blocked)
        self.group.timer.completed(self.group.kind)
        if self.slot is not None:
            self.group.recorder.end(self.slot)
        self.work = None


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        with blocking(group, "all_reduce"):
            dist.all_reduce(x, group=group.pg)
    return x


def all_gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    # Gather along dim 0 (contiguous chunks), then put the sequence dimension back.
    local = x.transpose(0, SEQ_DIM).contiguous()
    out = local.new_empty((group.size * local.shape[0],) + tuple(local.shape[1:]))
    with blocking(group, "all_gather"):
        dist.all_gather_single(out, local, group=group.pg)
    return out.transpose(0, SEQ_DIM).contiguous()


def reduce_scatter_seq_(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    full = x.transpose(0, SEQ_DIM).contiguous()
    out = full.new_empty((full.shape[0] // group.size,) + tuple(full.shape[1:]))
    with blocking(group, "reduce_scatter"):
        dist.reduce_scatter_single(out, full, group=group.pg)
    return out.transpose(0, SEQ_DIM).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq_(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterSeq.apply(x, group)


class EnterTP(torch.nn.Module):
    """Where a replicated (or sequence-sharded) activation enters a column-parallel region."""

    def __init__(self, group: Group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)


class ExitTP(torch.nn.Module):
    """Where partial sums of a row-parallel region are combined across the TP group."""

    def __init__(self, group: Group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_seq(x, self.group) if self.sequence_parallel else reduce_from_tp(x, self.group)
