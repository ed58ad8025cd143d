"""Gradient accumulation and the data-parallel reduce-scatter (`parallelism.zero`).

The parameters lie in one flat order cut into buckets (zero.py); every DP rank owns the same
slice of each bucket, and the optimizer's fp32 gradient shard is its slices end to end. A
parameter's gradient is taken as soon as autograd has accumulated it (a post-accumulate-grad
hook), and `p.grad` is dropped.

- `FullGradients` (`zero: 1`, as Megatron-LM's distributed optimizer): every microbatch's
  gradients accumulate into one fp32 buffer the size of all of this rank's parameters; a bucket
  is reduce-scattered once per step, as soon as its last microbatch's gradients are in.
- `ShardedGradients` (`zero: 2`, as DeepSpeed's stage 2): only the shard persists. A bucket's
  gradients of one microbatch accumulate in a bucket-sized staging buffer, reduce-scattered into
  the shard as soon as the bucket is complete, adding to what earlier microbatches left there.
  Gradient memory is the shard plus about two buckets; the price is a reduce-scatter per bucket
  per *microbatch* instead of per step, overlapped with backward in the same way. (Staging until
  the last microbatch instead would keep every bucket unsharded through the step: the full
  buffer again.)
- `LocalGradients` (a single DP rank, either level): the shard is the whole buffer, laid out like
  the parameters: no staging, no copy, nothing to reduce. fp32 parameters' `p.grad` are views of
  it that autograd accumulates into, with no hook.

With overlap on, a reduce-scatter runs while backward goes on; with it off, each one is waited
for where it is issued (zero 2) or all are issued after the last backward (zero 1).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.parallel.comm import InFlight, all_reduce
from megascale.parallel.topology import ParallelContext


@dataclass
class Bucket:
    start: int  # offset in the flat buffers
    size: int  # padded to a multiple of dp
    shard_start: int  # offset of this rank's slice in the flat master shard
    params: list[int]  # indices into DistributedOptimizer.params
    eager: bool  # may reduce-scatter during backward (no cross-stage sum needed first)


def _take_gradient(into: torch.Tensor, p: torch.Tensor) -> None:
    """Adds the gradient autograd just accumulated in `p.grad` into `into` (fp32) and drops it."""
    into.add_(p.grad.reshape(-1))
    p.grad = None


class _Gradients:
    """What both ways share: the flat layout, the shard they reduce into, one hook per parameter."""

    def __init__(self, params: list[nn.Parameter], offsets: list[int], buckets: list[Bucket], bucket_of: list[int],
                 grad_shard: torch.Tensor, ctx: ParallelContext, overlap: bool):
        self.params, self.offsets, self.buckets, self.bucket_of = params, offsets, buckets, bucket_of
        self.grad_shard, self.ctx, self.overlap = grad_shard, ctx, overlap

    def _register_hooks(self) -> None:
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def close(self) -> None:
        """Unhooks the parameters. A hook lives in C++ (the parameter's gradient accumulator), where the
        garbage collector cannot see the cycle parameter -> hook -> self -> parameter: left hooked, an
        in-process restart would keep every incarnation's model, buffers and process groups alive."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _shard_of(self, b: int) -> torch.Tensor:
        """This rank's slice of bucket `b` in the gradient shard."""
        bucket = self.buckets[b]
        return self.grad_shard[bucket.shard_start:bucket.shard_start + bucket.size // self.ctx.dp.size]

    def _sum_tied_embedding(self, b: int, bucket_grads: torch.Tensor) -> None:
        """A tied embedding's two pipeline copies (first and last stage) get the sum of both gradients."""
        bucket = self.buckets[b]
        for i in bucket.params:
            if getattr(self.params[i], "shared_embedding", False):
                off = self.offsets[i] - bucket.start
                all_reduce(bucket_grads[off:off + self.params[i].numel()], self.ctx.embedding)


class FullGradients(_Gradients):
    """ZeRO-1: a full fp32 gradient buffer, each bucket reduce-scattered once per step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        total = sum(b.size for b in self.buckets)
        self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=self.grad_shard.device)
        self.begin_step(1)
        self._reductions: dict[int, InFlight] = {}
        self._register_hooks()

    @property
    def nbytes(self) -> int:
        """Gradient bytes this rank holds: the full buffer and the shard."""
        return (self.grad_buffer.numel() + self.grad_shard.numel()) * 4

    def _hook(self, i: int):
        off, numel = self.offsets[i], self.params[i].numel()
        grad_view = self.grad_buffer[off:off + numel]

        def hook(p: torch.Tensor) -> None:
            _take_gradient(grad_view, p)
            self._accumulated[i] += 1
            if self._accumulated[i] == self.accumulations_per_step:
                b = self.bucket_of[i]
                self._bucket_pending[b] -= 1
                if self.overlap and self._bucket_pending[b] == 0 and self.buckets[b].eager:
                    self._reduce_scatter(b)
        return hook

    def begin_step(self, microbatches: int) -> None:
        self.accumulations_per_step = microbatches
        self._accumulated = [0] * len(self.params)
        self._bucket_pending = [len(b.params) for b in self.buckets]

    def _bucket_grads(self, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        return self.grad_buffer[bucket.start:bucket.start + bucket.size]

    def _reduce_scatter(self, b: int) -> None:
        out, full = self._shard_of(b), self._bucket_grads(b)
        if self.ctx.dp.size == 1:
            out.copy_(full)
            return
        work = dist.reduce_scatter_single(out, full, group=self.ctx.dp.pg, async_op=True)
        self._reductions[b] = InFlight(work, self.ctx.dp, "reduce_scatter")

    def finish(self) -> None:
        for b, bucket in enumerate(self.buckets):
            if b in self._reductions or (self.overlap and bucket.eager and self.ctx.dp.size > 1):
                continue
            self._sum_tied_embedding(b, self._bucket_grads(b))
            self._reduce_scatter(b)
        for work in self._reductions.values():
            work.wait()
        self._reductions.clear()

    def after_step(self) -> None:
        self.grad_buffer.zero_()

    def abandon(self) -> None:
        """Forgets a step abandoned part-way (an in-process restart): the gradients accumulated so far and the
        reductions in flight on process groups that are gone. The buffers stay allocated for the next step."""
        self._reductions.clear()
        self.grad_buffer.zero_()
        self.grad_shard.zero_()
        self.begin_step(1)


class ShardedGradients(_Gradients):
    """ZeRO-2: bucket-sized staging buffers reduce-scattered into the persistent shard per microbatch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.staging_numel = max(b.size for b in self.buckets)
        self._free: list[torch.Tensor] = []  # staging buffers not in use, reused before any new one is made
        self.staging_buffers = 0  # made so far: the peak number in use at once
        self._staging: dict[int, torch.Tensor] = {}  # bucket -> the staging buffer it accumulates in
        self._contributions = [0] * len(self.buckets)
        self._in_flight: Optional[tuple[InFlight, torch.Tensor]] = None
        self._register_hooks()

    @property
    def nbytes(self) -> int:
        """Gradient bytes this rank holds: the shard and every staging buffer made."""
        return (self.grad_shard.numel() + self.staging_buffers * self.staging_numel) * 4

    def _staging_of(self, b: int) -> torch.Tensor:
        """Bucket `b`'s gradients since its last reduce-scatter (a zeroed buffer on its first)."""
        if b not in self._staging:
            if not self._free:
                self.staging_buffers += 1
                self._free.append(self.grad_shard.new_empty(self.staging_numel))
            self._staging[b] = self._free.pop()
            self._staging[b][:self.buckets[b].size].zero_()
        return self._staging[b][:self.buckets[b].size]

    def _hook(self, i: int):
        b, numel = self.bucket_of[i], self.params[i].numel()
        bucket = self.buckets[b]
        off = self.offsets[i] - bucket.start

        def hook(p: torch.Tensor) -> None:
            _take_gradient(self._staging_of(b)[off:off + numel], p)
            self._contributions[b] += 1
            # A bucket is complete once it has as many gradients as parameters. (A bucket that
            # spans two virtual pipeline stages may count one stage's next microbatch first: the
            # sum is the same, and every DP rank counts alike, so their collectives pair up.)
            if bucket.eager and self._contributions[b] == len(bucket.params):
                self._reduce_scatter(b)
        return hook

    def begin_step(self, microbatches: int) -> None:
        """Nothing to prepare: a bucket is reduced once per microbatch whatever their number."""

    def _wait_in_flight(self) -> None:
        if self._in_flight is not None:
            work, buffer = self._in_flight
            work.wait()
            self._free.append(buffer)
            self._in_flight = None

    def _reduce_scatter(self, b: int) -> None:
        staging, out = self._staging_of(b), self._shard_of(b)
        buffer = self._staging.pop(b)
        self._contributions[b] = 0
        # One reduce-scatter in flight at a time: the previous one has had this bucket's whole
        # backward to finish, and waiting for it bounds the staging buffers (about two).
        self._wait_in_flight()
        if self.ctx.dp.size == 1:
            out.add_(staging)
            self._free.append(buffer)
            return
        # A reduce-scatter writes its output rather than adding to it: this rank adds its shard so
        # far to its own slice of the staging buffer, which the sum over ranks carries into the result.
        staging[self.ctx.dp.rank * out.numel():(self.ctx.dp.rank + 1) * out.numel()].add_(out)
        work = dist.reduce_scatter_single(out, staging, group=self.ctx.dp.pg, async_op=True)
        self._in_flight = (InFlight(work, self.ctx.dp, "reduce_scatter"), buffer)
        if not self.overlap:
            self._wait_in_flight()

    def finish(self) -> None:
        # What is left: buckets holding a tied embedding (summed across stages first), and buckets
        # short of a gradient. Every DP rank has the same left, in the same order.
        for b in range(len(self.buckets)):
            if not self.buckets[b].eager:
                self._sum_tied_embedding(b, self._staging_of(b))
            if b in self._staging:
                self._reduce_scatter(b)
        self._wait_in_flight()

    def after_step(self) -> None:
        self.grad_shard.zero_()

    def abandon(self) -> None:
        """As FullGradients.abandon: the staging buffers go back to the free list."""
        if self._in_flight is not None:
            self._free.append(self._in_flight[1])
            self._in_flight = None
        self._free.extend(self._staging.values())
        self._staging.clear()
        self._contributions = [0] * len(self.buckets)
        self.grad_shard.zero_()


class LocalGradients(_Gradients):
    """One DP rank: the shard is laid out like the parameters, so nothing is staged, copied or reduced, which
    either class above would do for nothing. fp32 parameters: each `p.grad` is its view of the shard, and
    autograd adds every microbatch's gradient straight into it, with no hook (a Python call per parameter
    per microbatch). Lower precision: a hook adds each gradient into the fp32 shard, as above."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ctx.dp.size != 1:
            raise ValueError(f"LocalGradients is for one DP rank, not {self.ctx.dp.size}")
        self.grad_views = all(p.dtype == torch.float32 for p in self.params)
        if self.grad_views:
            self._hooks = []
            self._attach()
        else:
            self._register_hooks()

    def _attach(self) -> None:
        for p, off in zip(self.params, self.offsets):
            p.grad = self.grad_shard[off:off + p.numel()].view_as(p)

    @property
    def nbytes(self) -> int:
        return self.grad_shard.numel() * 4

    def _hook(self, i: int):
        off = self.offsets[i]
        return functools.partial(_take_gradient, self.grad_shard[off:off + self.params[i].numel()])

    def begin_step(self, microbatches: int) -> None:
        """Nothing to count: there is no reduction to start."""

    def finish(self) -> None:
        for b, bucket in enumerate(self.buckets):
            if not bucket.eager:
                self._sum_tied_embedding(b, self._shard_of(b))

    def after_step(self) -> None:
        self.grad_shard.zero_()

    def abandon(self) -> None:
        self.grad_shard.zero_()
        if self.grad_views:
            self._attach()
