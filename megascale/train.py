"""The one training loop: every rank runs `Trainer.step` in lockstep."""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from megascale.config import JobConfig
from megascale.model.gpt import GPT
from megascale.parallel.comm import all_reduce
from megascale.parallel.parallelize import compute_dtype, parallelize
from megascale.parallel.pipeline import run_schedule
from megascale.parallel.topology import ParallelContext
from megascale.synthetic import SyntheticSource
from megascale.timers import StepTimings


class BatchSource(Protocol):
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time: float
    tokens_per_s: float
    timings: dict  # StepTimings.to_dict() of this rank


def learning_rate(cfg: JobConfig, step: int) -> float:
    """Linear warm-up, then constant / cosine / linear decay to min_lr_ratio * lr."""
    opt, sched = cfg.optimizer, cfg.optimizer.schedule
    if step < sched.warmup_steps:
        return opt.lr * (step + 1) / sched.warmup_steps
    if sched.kind == "constant":
        return opt.lr
    progress = min(1.0, (step - sched.warmup_steps) / max(1, cfg.train.steps - sched.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if sched.kind == "cosine" else 1 - progress
    return opt.lr * (sched.min_lr_ratio + (1 - sched.min_lr_ratio) * shape)


def make_source(cfg: JobConfig, ctx: ParallelContext, ranks_per_node: Optional[int] = None) -> BatchSource:
    """The job's data: synthetic, or token shards served by one loader process per node."""
    if cfg.data.source == "synthetic":
        return SyntheticSource(vocab=cfg.model.vocab, seq=cfg.model.seq, global_batch=cfg.batch.global_,
                               dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, seed=cfg.data.seed)
    from megascale.data import make_batch_source

    return make_batch_source(cfg.data, seq=cfg.model.seq, micro=cfg.batch.micro, microbatches=cfg.microbatches,
                             dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, tp_rank=ctx.tp.rank, tp_size=ctx.tp.size,
                             pp_rank=ctx.pp.rank, pp_size=ctx.pp.size, global_rank=ctx.rank,
                             ranks_per_node=ranks_per_node, run_dir=cfg.train.run_dir, vocab=cfg.model.vocab)


def _microbatches(batch: torch.Tensor, count: int, device: torch.device) -> list[Optional[torch.Tensor]]:
    # Middle pipeline stages receive empty tensors: they read activations, not tokens.
    return [t.to(device) for t in batch.chunk(count)] if batch.numel() else [None] * count


class Trainer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, source: Optional[BatchSource] = None,
                 ranks_per_node: Optional[int] = None):
        self.cfg, self.ctx = cfg, ctx
        with torch.device("meta"):  # each rank materialises only what it owns (parallelize)
            model = GPT(cfg.model)
        self.chunks, self.optimizer = parallelize(model, ctx, cfg)
        self.dtype = compute_dtype(cfg, ctx.device)
        self.source = source or make_source(cfg, ctx, ranks_per_node)
        self.step_index = 0
        seq = cfg.model.seq // ctx.tp.size if ctx.sequence_parallel else cfg.model.seq
        self.activation_shape = (cfg.batch.micro, seq, cfg.model.hidden)
        # MegaScale: ranks collecting garbage at different times stall each other's
        # collectives; collect on every rank at the same step instead.
        gc.collect()
        gc.freeze()
        gc.disable()

    def _loss_weights(self, labels: list[torch.Tensor]) -> list[float]:
        """Scales each microbatch's mean loss to its share of the global batch's tokens."""
        if not self.ctx.is_last_stage:
            return [0.0] * len(labels)
        counts = torch.tensor([float((lab != -100).sum()) for lab in labels], dtype=torch.float64)
        total = all_reduce(counts.sum().reshape(1), self.ctx.dp).item()
        return (counts / max(total, 1.0)).tolist()

    def step(self) -> StepStats:
        started, wall = time.perf_counter(), time.time()
        cfg, ctx, timer = self.cfg, self.ctx, self.ctx.timer
        microbatches = cfg.microbatches
        with timer.span("data"):
            input_ids, labels = self.source.next_batch()
            inputs, targets = (_microbatches(t, microbatches, ctx.device) for t in (input_ids, labels))
        self.optimizer.begin_step(microbatches)
        loss = run_schedule(self.chunks, ctx, inputs, targets, self._loss_weights(targets),
                            self.activation_shape, self.dtype, overlap=cfg.parallelism.overlap.pp)
        lr = learning_rate(cfg, self.step_index)
        with timer.span("optimizer"):
            grad_norm = self.optimizer.step(lr)
        # Every rank learns the loss: the last stage's DP partial sums, shared along the pipeline.
        loss = all_reduce(all_reduce(loss.reshape(1).float(), ctx.dp), ctx.pp).item()
        self.step_index += 1
        if cfg.train.gc_every and self.step_index % cfg.train.gc_every == 0:
            gc.collect()
        elapsed = time.perf_counter() - started
        timings = StepTimings(self.step_index, ctx.rank, ctx.tp.rank, ctx.pp.rank, ctx.dp.rank, wall, elapsed,
                              timer.collect())
        tokens = cfg.batch.global_ * cfg.model.seq
        return StepStats(self.step_index, loss, grad_norm, lr, elapsed, tokens / elapsed, timings.to_dict())

    def finish(self) -> None:
        """Completes what the last step left in flight (the next step's parameter all-gathers): a process
        group destroyed under a running gloo collective aborts the process ("terminate called ...")."""
        self.optimizer.wait_for_params()

    def close(self) -> None:
        self.source.close()
        gc.unfreeze()
        gc.enable()
