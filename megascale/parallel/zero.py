"""ZeRO-2 distributed optimizer over the data-parallel group.

Gradients accumulate (fp32) into one flat buffer cut into buckets; each bucket is
reduce-scattered over DP so every rank holds 1/dp of it; each rank updates fp32
master weights and optimizer state for its slice only; the updated slices are
all-gathered back into the flat parameter buffer the model's parameters view.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.distributed as dist
import torch.nn as nn

from megascale.config import OptimizerConfig
from megascale.optim.update import adamw_step, lamb_step
from megascale.parallel.comm import all_reduce
from megascale.parallel.topology import ParallelContext


@dataclass
class Bucket:
    start: int  # offset in the flat buffers
    size: int  # padded to a multiple of dp
    shard_start: int  # offset of this rank's slice in the flat master shard


class DistributedOptimizer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], ctx: ParallelContext,
                 cfg: OptimizerConfig, bucket_mb: float = 4.0):
        self.ctx, self.cfg = ctx, cfg
        self.step_count = 0
        dp = ctx.dp.size
        # Reverse order of use: backward produces the last layers' gradients first,
        # so the first bucket completes first.
        self.names = [n for n, _ in named_params][::-1]
        self.params = [p for _, p in named_params][::-1]
        numels = [p.numel() for p in self.params]
        device, param_dtype = self.params[0].device, self.params[0].dtype

        self.offsets, self.buckets = [], []
        offset = bucket_start = shard_offset = 0
        bucket_limit = max(1, int(bucket_mb * 2**20 / 4))
        for i, n in enumerate(numels):
            self.offsets.append(offset)
            offset += n
            if offset - bucket_start >= bucket_limit or i == len(numels) - 1:
                size = -(-(offset - bucket_start) // dp) * dp
                self.buckets.append(Bucket(bucket_start, size, shard_offset))
                shard_offset += size // dp
                offset = bucket_start = bucket_start + size
        total, shard_total = offset, shard_offset

        self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self.param_buffer = torch.zeros(total, dtype=param_dtype, device=device)
        owner = torch.full((total,), len(self.params), dtype=torch.long, device=device)
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            view = self.param_buffer[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            owner[off:off + p.numel()] = i
            p.register_post_accumulate_grad_hook(self._accumulate_hook(self.grad_buffer[off:off + p.numel()]))

        self.shard_ranges = [(b.start + ctx.dp.rank * b.size // dp, b.size // dp) for b in self.buckets]
        self.segment_ids = torch.cat([owner[s:s + n] for s, n in self.shard_ranges])
        self.master = torch.cat([self.param_buffer[s:s + n] for s, n in self.shard_ranges]).float()
        self.grad_shard = torch.zeros(shard_total, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

        decayed = torch.tensor([p.dim() > 1 for p in self.params] + [False], device=device)
        self.segment_decayed = decayed[:-1]
        self.decay = decayed[self.segment_ids].float() * cfg.weight_decay
        tp_sharded = torch.tensor([getattr(p, "tensor_parallel", False) for p in self.params], device=device)
        self.tp_sharded = tp_sharded
        # Count each parameter once in the global grad norm: TP-replicated ones on TP rank 0
        # only, and a tied embedding's second copy (last pipeline stage) not at all.
        counted = [(getattr(p, "tensor_parallel", False) or ctx.tp.rank == 0)
                   and not getattr(p, "duplicate_of_first_stage", False) for p in self.params]
        self.counted = torch.tensor(counted + [False], device=device)[self.segment_ids]

    @staticmethod
    def _accumulate_hook(grad_view: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            grad_view.add_(p.grad.reshape(-1))
            p.grad = None
        return hook

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()

    def _grad_view(self, i: int) -> torch.Tensor:
        off = self.offsets[i]
        return self.grad_buffer[off:off + self.params[i].numel()]

    def _reduce_model_parallel_grads(self) -> None:
        """Gradients that need a sum over model-parallel peers before the DP reduction."""
        for i, p in enumerate(self.params):
            if getattr(p, "sequence_parallel", False):
                all_reduce(self._grad_view(i), self.ctx.tp)  # LayerNorm saw only this rank's tokens
            if getattr(p, "shared_embedding", False):
                all_reduce(self._grad_view(i), self.ctx.embedding)  # tied input/output embedding

    def _reduce_scatter_grads(self) -> None:
        works = []
        for b, (_, n) in zip(self.buckets, self.shard_ranges):
            out = self.grad_shard[b.shard_start:b.shard_start + n]
            full = self.grad_buffer[b.start:b.start + b.size]
            if self.ctx.dp.size == 1:
                out.copy_(full)
            else:
                works.append(dist.reduce_scatter_single(out, full, group=self.ctx.dp.pg, async_op=True))
        for w in works:
            w.wait()

    def _all_gather_params(self) -> None:
        works = []
        for b, (_, n) in zip(self.buckets, self.shard_ranges):
            shard = self.master[b.shard_start:b.shard_start + n].to(self.param_buffer.dtype)
            full = self.param_buffer[b.start:b.start + b.size]
            if self.ctx.dp.size == 1:
                full.copy_(shard)
            else:
                works.append(dist.all_gather_single(full, shard, group=self.ctx.dp.pg, async_op=True))
        for w in works:
            w.wait()

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
        local = (self.grad_shard.square() * self.counted).sum()
        return self._sum_over_world(local).sqrt().item()

    def step(self, lr: float) -> float:
        """Reduces gradients, clips, updates this rank's shard, all-gathers parameters.

        Returns the global gradient norm before clipping.
        """
        self._reduce_model_parallel_grads()
        self._reduce_scatter_grads()
        norm = self.grad_norm()
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            self.grad_shard.mul_(self.cfg.clip_grad / (norm + 1e-6))
        self.step_count += 1
        update = lamb_step if self.cfg.name == "lamb" else adamw_step
        update(self.master, self.grad_shard, self.exp_avg, self.exp_avg_sq, step=self.step_count, lr=lr,
               betas=tuple(self.cfg.betas), eps=self.cfg.eps, decay=self.decay, segment_ids=self.segment_ids,
               segment_decayed=self.segment_decayed, reduce_norms=self._reduce_parameter_norms)
        self._all_gather_params()
        self.zero_grad()
        return norm

    def _owned_pieces(self):
        """(param index, start within the flat param, length, offset in this rank's shard) per owned piece."""
        for (start, n), bucket in zip(self.shard_ranges, self.buckets):
            for i, (off, p) in enumerate(zip(self.offsets, self.params)):
                lo, hi = max(start, off), min(start + n, off + p.numel())
                if lo < hi:
                    yield i, lo - off, hi - lo, bucket.shard_start + lo - start

    def shard_state(self) -> dict:
        """This rank's optimizer state in a layout-free form: pieces of named, flattened
        parameters, so a checkpoint restores onto any DP size."""
        pieces = []
        for i, start, length, at in self._owned_pieces():
            pieces.append({"name": self.names[i], "start": start, "length": length,
                           **{k: getattr(self, k)[at:at + length].clone() for k in STATE_KEYS}})
        return {"step": self.step_count, "pieces": pieces}

    def load_shard_state(self, step: int, lookup) -> None:
        """Fills this rank's shard from `lookup(name, start, length) -> {key: tensor}` (keys STATE_KEYS)."""
        self.step_count = int(step)
        for i, start, length, at in self._owned_pieces():
            found = lookup(self.names[i], start, length)
            for key in STATE_KEYS:
                getattr(self, key)[at:at + length].copy_(found[key])
        self._all_gather_params()


STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
