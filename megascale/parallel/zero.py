"""ZeRO distributed optimizer over the data-parallel group.

The parameters lie in one flat buffer cut into buckets; their gradients are reduce-scattered
bucket by bucket over DP so every rank holds 1/dp of them (grad_buffers.py: with a full gradient
buffer per rank, `zero: 1`, or without, `zero: 2`); each rank updates fp32 master weights and
optimizer state for its slice only; the updated slices are all-gathered back into the flat
parameter buffer the model's parameters view.

With overlap on (MegaScale §3.2), a bucket's reduce-scatter starts during backward
as soon as its gradients are in, and the next step's all-gathers are
issued per bucket in the order forward uses them; forward waits only for the
bucket it is about to read.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.checkpoint.stateful import ParamLayout, ShardedFlat, Split
from megascale.config import OptimizerConfig
from megascale.optim.update import Segments, adamw_step, lamb_step
from megascale.parallel.comm import InFlight, all_reduce
from megascale.parallel.grad_buffers import Bucket, FullGradients, LocalGradients, ShardedGradients
from megascale.parallel.topology import ParallelContext

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


# Buckets per rank when parallelism.grad_bucket_mb is not set, and the bounds of one bucket's fp32 bytes.
AUTO_BUCKETS, AUTO_BUCKET_MB = 8, (1.0, 64.0)


def auto_bucket_numel(params: list[nn.Parameter]) -> int:
    """Elements per bucket: about AUTO_BUCKETS buckets of these gradients, 1 to 64 MB each. Several buckets, so
    the first one's reduce-scatter runs while backward computes the rest (a model whose rank holds less than
    one fixed-size bucket had nothing to overlap: 1.08x slower at 8 ranks on a 0.2 Gbit/s emulated link); a
    bounded size, so each collective stays large enough to run at the link's bandwidth."""
    total = sum(p.numel() for p in params)
    low, high = (int(mb * 2**20 / 4) for mb in AUTO_BUCKET_MB)
    return min(max(-(-total // AUTO_BUCKETS), low), high)


class DistributedOptimizer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], ctx: ParallelContext,
                 cfg: OptimizerConfig, bucket_mb: Optional[float] = None, overlap: bool = True,
                 zero: Literal[1, 2] = 2):
        self.ctx, self.cfg, self.overlap = ctx, cfg, overlap
        self.step_count = 0
        dp = ctx.dp.size
        # Reverse order of use: backward produces the last layers' gradients first,
        # so the first bucket completes first.
        self.names = [n for n, _ in named_params][::-1]
        self.params = [p for _, p in named_params][::-1]
        device, param_dtype = self.params[0].device, self.params[0].dtype

        self.offsets, self.buckets, self.bucket_of = [], [], []
        offset = bucket_start = shard_offset = 0
        members: list[int] = []
        bucket_limit = max(1, int(bucket_mb * 2**20 / 4)) if bucket_mb else auto_bucket_numel(self.params)
        for i, p in enumerate(self.params):
            self.offsets.append(offset)
            self.bucket_of.append(len(self.buckets))
            members.append(i)
            offset += p.numel()
            if offset - bucket_start >= bucket_limit or i == len(self.params) - 1:
                size = -(-(offset - bucket_start) // dp) * dp
                eager = not any(getattr(self.params[j], "shared_embedding", False) for j in members)
                self.buckets.append(Bucket(bucket_start, size, shard_offset, members, eager))
                shard_offset += size // dp
                offset = bucket_start = bucket_start + size
                members = []
        total, shard_total = offset, shard_offset

        self.param_buffer = torch.zeros(total, dtype=param_dtype, device=device)
        owner = torch.full((total,), len(self.params), dtype=torch.long, device=device)
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            view = self.param_buffer[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            owner[off:off + p.numel()] = i

        self.shard_ranges = [(b.start + ctx.dp.rank * b.size // dp, b.size // dp) for b in self.buckets]
        self.segment_ids = self._owned(owner)
        self.segments = Segments(self.segment_ids, len(self.params))
        # One fp32 DP rank: the master weights are the parameters themselves (otherwise the same values twice,
        # and a copy of all of them after every step).
        self.master_is_params = dp == 1 and param_dtype == torch.float32
        self.master = self.param_buffer if self.master_is_params else self._owned(self.param_buffer).float()
        self.grad_shard = torch.zeros(shard_total, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

        def per_element(flags: list[bool]) -> torch.Tensor:
            return torch.tensor(flags + [False], device=device)[self.segment_ids]

        self.segment_decayed = torch.tensor([p.dim() > 1 for p in self.params], device=device)
        self.decay = per_element([p.dim() > 1 for p in self.params]).float() * cfg.weight_decay
        self.tp_sharded = torch.tensor([getattr(p, "tensor_parallel", False) for p in self.params], device=device)
        # Count each parameter once in the global grad norm: TP-replicated ones on TP rank 0
        # only, and a tied embedding's second copy (last pipeline stage) not at all.
        self.counted = torch.tensor([(getattr(p, "tensor_parallel", False) or ctx.tp.rank == 0)
                                     and not getattr(p, "duplicate_of_first_stage", False) for p in self.params],
                                    device=device)
        # Sequence-parallel LayerNorm grads are partial over TP; the sum commutes with the DP
        # reduce-scatter, so it is applied to the (1/dp smaller) shard afterwards.
        self.sequence_parallel_elements = per_element(
            [getattr(p, "sequence_parallel", False) for p in self.params]).nonzero().flatten()

        gradients = LocalGradients if ctx.dp.size == 1 else FullGradients if zero == 1 else ShardedGradients
        self.gradients = gradients(self.params, self.offsets, self.buckets, self.bucket_of, self.grad_shard, ctx,
                                   overlap)
        self._gathers: dict[int, tuple[InFlight, torch.Tensor]] = {}

    # ---- gradients -------------------------------------------------------------------

    def begin_step(self, microbatches: int) -> None:
        """Each parameter's gradient will accumulate `microbatches` times before it is final."""
        self.gradients.begin_step(microbatches)

    def finish_grad_sync(self) -> None:
        """Completes every gradient reduction of this step (after the last backward)."""
        self.gradients.finish()
        if self.sequence_parallel_elements.numel():
            partial = self.grad_shard[self.sequence_parallel_elements]
            self.grad_shard[self.sequence_parallel_elements] = all_reduce(partial, self.ctx.tp)

    def abandon_step(self) -> None:
        """Forgets a step abandoned part-way (an in-process restart keeps this optimizer): its gradients and
        the collectives it had in flight. Weights and moments may be half-updated: the restore that follows
        overwrites them (load_state_dict), or `reset_to` does."""
        self._gathers.clear()
        for p in self.params:
            p.grad = None
        self.gradients.abandon()

    def _owned(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's ZeRO shard of a buffer laid out like `param_buffer`: its part of every bucket, joined."""
        return torch.cat([flat[s:s + n] for s, n in self.shard_ranges])

    def reset_to(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        """Takes `named_params` (a newly built model's, of this rank's layout) as the weights, with the state of a
        new optimizer: this one is then as it would be if built for that model. Local: no collective."""
        if [name for name, _ in named_params][::-1] != self.names:
            raise ValueError("the parameters to reset to are not this optimizer's")
        for (_, new), p in zip(named_params[::-1], self.params):
            p.data.copy_(new.detach())  # a view of param_buffer
        self.master.copy_(self._owned(self.param_buffer))
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step_count = 0

    def close(self) -> None:
        """Unhooks the parameters (see `close` in grad_buffers.py); the optimizer steps no more after it."""
        self.gradients.close()

    # ---- parameters ------------------------------------------------------------------

    def _all_gather_params(self) -> None:
        if self.master_is_params:
            return
        # Forward reads the last bucket first (buckets are in reverse order of use).
        for b in reversed(range(len(self.buckets))):
            bucket, (_, n) = self.buckets[b], self.shard_ranges[b]
            shard = self.master[bucket.shard_start:bucket.shard_start + n].to(self.param_buffer.dtype)
            full = self.param_buffer[bucket.start:bucket.start + bucket.size]
            if self.ctx.dp.size == 1:
                full.copy_(shard)
                continue
            work = InFlight(dist.all_gather_single(full, shard, group=self.ctx.dp.pg, async_op=True), self.ctx.dp,
                            "all_gather")
            self._gathers[b] = (work, shard)  # the shard must outlive the collective
        if not self.overlap:
            self.wait_for_params()

    def wait_for_params(self, buckets=None) -> None:
        """Blocks until the given (default: all) buckets' parameters are up to date."""
        for b in list(self._gathers) if buckets is None else buckets:
            if b in self._gathers:
                self._gathers.pop(b)[0].wait()

    def attach(self, modules: list[nn.Module]) -> None:
        """Makes forward wait, module by module, only for the buckets it is about to read."""
        index = {id(p): i for i, p in enumerate(self.params)}
        for root in modules:
            for module in root.modules():
                buckets = sorted({self.bucket_of[index[id(p)]] for p in module.parameters(recurse=False)
                                  if id(p) in index})
                if buckets:
                    module.register_forward_pre_hook(lambda _m, _a, bs=tuple(buckets): self.wait_for_params(bs))

    # ---- the step --------------------------------------------------------------------

    def _sum_over_world(self, x: torch.Tensor) -> torch.Tensor:
        for group in (self.ctx.dp, self.ctx.tp, self.ctx.pp):
            all_reduce(x, group)
        return x

    def _reduce_parameter_norms(self, sums: torch.Tensor) -> torch.Tensor:
        """Partial per-parameter sums of squares -> whole-parameter sums (over DP shards and TP slices)."""
        all_reduce(sums, self.ctx.dp)
        if self.ctx.tp.size > 1:
            sharded = sums * self.tp_sharded
            all_reduce(sharded, self.ctx.tp)
            sums = torch.where(self.tp_sharded, sharded, sums)
        return sums

    def grad_norm(self) -> float:
        local = (self.segments.sum_of_squares(self.grad_shard) * self.counted).sum()  # one pass over the shard
        return self._sum_over_world(local).sqrt().item()

    def step(self, lr: float) -> float:
        """Finishes gradient sync, clips, updates this rank's shard, re-gathers parameters.

        Returns the global gradient norm before clipping.
        """
        self.finish_grad_sync()
        norm = self.grad_norm()
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            self.grad_shard.mul_(self.cfg.clip_grad / (norm + 1e-6))
        self.step_count += 1
        update = lamb_step if self.cfg.name == "lamb" else adamw_step
        update(self.master, self.grad_shard, self.exp_avg, self.exp_avg_sq, step=self.step_count, lr=lr,
               betas=tuple(self.cfg.betas), eps=self.cfg.eps, decay=self.decay, segments=self.segments,
               segment_decayed=self.segment_decayed, reduce_norms=self._reduce_parameter_norms)
        self._all_gather_params()
        self.gradients.after_step()
        return norm

    # ---- checkpoint state --------------------------------------------------------------

    def owned_pieces(self):
        """(param index, start within the flat param, length, offset in this rank's shard) per owned piece."""
        for (start, n), bucket in zip(self.shard_ranges, self.buckets):
            for i in bucket.params:
                off, numel = self.offsets[i], self.params[i].numel()
                lo, hi = max(start, off), min(start + n, off + numel)
                if lo < hi:
                    yield i, lo - off, hi - lo, bucket.shard_start + lo - start

    def state_dict(self) -> dict:
        """The step count and this rank's ZeRO shard (master weights and moments) as pieces of named
        parameters, so an optimizer of another DP size can restore it."""
        pieces = [(self.names[i], start, length, at) for i, start, length, at in self.owned_pieces()]
        params = {name: _param_layout(p, self.ctx.tp.size) for name, p in zip(self.names, self.params)}
        return {"step": self.step_count,
                "shard": ShardedFlat({key: getattr(self, key) for key in STATE_KEYS}, pieces, params)}

    def load_state_dict(self, state: dict) -> None:
        """Takes a shard cut as this rank's (`state_dict`'s pieces), then all-gathers the parameters."""
        shard: ShardedFlat = state["shard"]
        if [tuple(p) for p in shard.pieces] != [(self.names[i], *rest) for i, *rest in self.owned_pieces()]:
            raise ValueError("the ZeRO shard to load is not cut as this rank's")
        self.step_count = int(state["step"])
        for key in STATE_KEYS:
            getattr(self, key).copy_(shard.tensors[key])
        self._all_gather_params()
        self.wait_for_params()


def _param_layout(p: nn.Parameter, tp: int) -> ParamLayout:
    """A parameter's full shape and how TP cut it (tensor_parallel.mark_tensor_parallel)."""
    if not getattr(p, "tensor_parallel", False):
        return ParamLayout(tuple(p.shape))
    shape = list(p.shape)
    shape[p.tp_dim] *= tp
    return ParamLayout(tuple(shape), Split(p.tp_dim, tp, p.tp_sections))
