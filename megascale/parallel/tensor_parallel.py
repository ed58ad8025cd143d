"""Tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding and
vocab-parallel cross-entropy (the full logits are never gathered).

Each layer is built from the single-device module's full weight, so an N-rank
model starts from exactly the weights of the 1-rank model.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megascale.parallel.comm import EnterTP, ExitTP, all_reduce, blocking, reduce_from_tp, reduce_scatter_seq
from megascale.parallel.topology import Group
from megascale.parallel.tp_overlap import GatherThenLinear, LinearThenReduceScatter


def mark_tensor_parallel(p: nn.Parameter, dim: int, sections: Optional[Sequence[int]] = None) -> nn.Parameter:
    """A parameter each TP rank holds a different slice of, along `dim` (its norms sum over TP).
    `tp_sections`: the full row counts of a fused weight's sub-matrices, None for a plain one."""
    p.tensor_parallel, p.tp_dim, p.tp_sections = True, dim, None if sections is None else tuple(sections)
    return p


def shard_out_features(weight: torch.Tensor, group: Group, sections: Optional[Sequence[int]] = None
                       ) -> nn.Parameter:
    """Rows of `weight` for this rank. A fused weight's `sections` (row counts, e.g. of q, k, v) are
    split separately, so each rank gets its share of every one."""
    parts = weight.split(list(sections or [weight.shape[0]]), dim=0)
    mine = torch.cat([part.chunk(group.size, dim=0)[group.rank] for part in parts])
    return mark_tensor_parallel(nn.Parameter(mine), 0, sections)


def shard_in_features(weight: torch.Tensor, group: Group) -> nn.Parameter:
    return mark_tensor_parallel(nn.Parameter(weight.chunk(group.size, dim=1)[group.rank].clone()), 1)


def unshard(shards: list[torch.Tensor], dim: int, sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Inverse of the shard functions: the full weight from every TP rank's slice, in rank order."""
    if dim == 1:
        return torch.cat(shards, dim=1)
    sections = sections or [sum(s.shape[0] for s in shards)]
    per_rank = [s.split([rows // len(shards) for rows in sections], dim=0) for s in shards]
    return torch.cat([parts[i] for i in range(len(sections)) for parts in per_rank])


class ColumnParallelLinear(nn.Module):
    """y_local = enter(x) @ W_local^T: each rank computes a slice of the output features.

    With `overlap_chunks` > 1 a sequence-parallel all-gather is pipelined with the GEMM.
    """

    def __init__(self, weight: nn.Parameter, enter: Optional[EnterTP] = None, overlap_chunks: int = 0):
        super().__init__()
        self.weight, self.enter, self.overlap_chunks = weight, enter, overlap_chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter is None:
            return F.linear(x, self.weight)
        if self.overlap_chunks > 1 and self.enter.sequence_parallel and self.enter.group.size > 1:
            return GatherThenLinear.apply(x, self.weight, self.enter.group, min(self.overlap_chunks, x.shape[0]))
        return F.linear(self.enter(x), self.weight)


class RowParallelLinear(nn.Module):
    """y = exit(x_local @ W_local^T): partial sums combined by all-reduce or reduce-scatter.

    With `overlap_chunks` > 1 a sequence-parallel reduce-scatter is pipelined with the GEMM.
    """

    def __init__(self, weight: nn.Parameter, exit: Optional[ExitTP] = None, overlap_chunks: int = 0):
        super().__init__()
        self.weight, self.exit, self.overlap_chunks = weight, exit, overlap_chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exit is None:
            return F.linear(x, self.weight)
        if self.overlap_chunks > 1 and self.exit.sequence_parallel and self.exit.group.size > 1:
            return LinearThenReduceScatter.apply(x, self.weight, self.exit.group, min(self.overlap_chunks, x.shape[0]))
        return self.exit(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Each rank owns a contiguous vocabulary range; rows outside it contribute zeros."""

    def __init__(self, weight: nn.Parameter, group: Group, sequence_parallel: bool):
        super().__init__()
        self.weight, self.group, self.sequence_parallel = weight, group, sequence_parallel
        self.vocab_start = group.rank * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(out, self.group)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        if group.size > 1:
            with blocking(group, "all_reduce"):
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group.pg)
        shifted = logits - row_max.unsqueeze(-1)

        valid = labels != -100
        local_label = labels - vocab_start
        mine = valid & (local_label >= 0) & (local_label < vocab_local)
        local_label = local_label.masked_fill(~mine, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        # One all-reduce for both sums.
        both = all_reduce(torch.stack([target, sum_exp]), group)
        target, sum_exp = both[0], both[1]

        count = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / count
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_label, mine, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, mine, valid, count = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_label] -= mine.to(grad.dtype)
        grad *= (valid.to(grad.dtype) * grad_loss / count).unsqueeze(-1)
        return grad, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean token loss over vocab-sharded logits `[batch, seq, vocab/tp]`; labels of -100 ignored."""

    def __init__(self, group: Group, vocab_start: int):
        super().__init__()
        self.group, self.vocab_start = group, vocab_start

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), self.vocab_start, self.group)
