"""The one training loop: every rank runs `Trainer.step` in lockstep; `train_rank` is the outer loop
(logs, metrics, checkpoints) that every way of starting a rank runs."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from megascale.common.jsonl import RollingWriter
from megascale.config import JobConfig
from megascale.model.gpt import GPT
from megascale.parallel.comm import all_reduce
from megascale.parallel.parallelize import compute_dtype, parallelize, shard_model, unique_named_parameters
from megascale.parallel.pipeline import document_ids_on_every_stage, run_schedule
from megascale.parallel.topology import Layout, ParallelContext
from megascale.synthetic import SyntheticSource
from megascale.timers import StepTimings

log = logging.getLogger("megascale.train")


class BatchSource(Protocol):
    """(input_ids, labels) per step. A source of documents (data.document_mask) also has `next_sample()`,
    whose `document_ids` say which document each input token belongs to."""

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


def make_source(cfg: JobConfig, ctx: ParallelContext, run_dir: Optional[str] = None) -> BatchSource:
    """The job's data: synthetic, or token shards served by one loader process per node (of the job's
    cluster.ranks_per_node ranks: each node, a machine or a pod or a network namespace of its own, starts its
    own). `run_dir`, this run's own directory, names the loaders' sockets apart from any other run's on the
    machine (without it: train.run_dir, which runs may share)."""
    if cfg.data.source == "synthetic":
        return SyntheticSource(vocab=cfg.model.vocab, seq=cfg.model.seq, global_batch=cfg.batch.global_,
                               dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, seed=cfg.data.seed)
    from megascale.data import make_batch_source

    return make_batch_source(cfg.data, seq=cfg.model.seq, micro=cfg.batch.micro, microbatches=cfg.microbatches,
                             dp_rank=ctx.dp.rank, dp_size=ctx.dp.size, tp_rank=ctx.tp.rank, tp_size=ctx.tp.size,
                             pp_rank=ctx.pp.rank, pp_size=ctx.pp.size, global_rank=ctx.rank,
                             ranks_per_node=cfg.ranks_per_node, run_dir=cfg.train.run_dir,
                             job_dir=run_dir, vocab=cfg.model.vocab, holdout=cfg.eval.split)


def split_microbatches(batch: torch.Tensor, count: int, device: torch.device) -> list[Optional[torch.Tensor]]:
    # Middle pipeline stages receive empty tensors: they read activations, not tokens.
    return [t.to(device) for t in batch.chunk(count)] if batch.numel() else [None] * count


class Trainer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, source: Optional[BatchSource] = None,
                 run_dir: Optional[str] = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.chunks, self.optimizer = parallelize(self._meta_model(), ctx, cfg)
        self.dtype = compute_dtype(cfg, ctx.device)
        self.source = source or make_source(cfg, ctx, run_dir)
        self.step_index = 0
        seq = cfg.model.seq // ctx.tp.size if ctx.sequence_parallel else cfg.model.seq
        self.activation_shape = (cfg.batch.micro, seq, cfg.model.hidden)
        self._freeze_gc()

    def _meta_model(self) -> GPT:
        with torch.device("meta"):  # each rank materialises only what it owns (parallelize)
            return GPT(self.cfg.model)

    @staticmethod
    def _freeze_gc() -> None:
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

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(input_ids, labels, document ids on this rank's device, or None without data.document_mask)."""
        if not self.cfg.data.document_mask:
            return (*self.source.next_batch(), None)
        batch = self.source.next_sample()
        rows = self.cfg.microbatches * self.cfg.batch.micro
        shared = document_ids_on_every_stage(batch.document_ids, self.ctx, (rows, self.cfg.model.seq))
        return batch.input_ids, batch.labels, shared

    def step(self) -> StepStats:
        started, wall = time.perf_counter(), time.time()
        cfg, ctx, timer = self.cfg, self.ctx, self.ctx.timer
        microbatches = cfg.microbatches
        with timer.span("data"):
            input_ids, labels, document_ids = self._next_batch()
            inputs, targets = (split_microbatches(t, microbatches, ctx.device) for t in (input_ids, labels))
            documents = None if document_ids is None else list(document_ids.chunk(microbatches))
        self.optimizer.begin_step(microbatches)
        loss = run_schedule(self.chunks, ctx, inputs, targets, self._loss_weights(targets),
                            self.activation_shape, self.dtype, overlap=cfg.parallelism.overlap.pp,
                            document_ids=documents)
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
        self.optimizer.close()
        gc.unfreeze()
        gc.enable()

    def suspend(self) -> None:
        """Out of an incarnation that ended part-way, kept for the next (KeptTrainer): forgets the abandoned
        step, closes the data source and lets go of the process groups; the model and optimizer stay."""
        self.optimizer.abandon_step()
        self.source.close()
        self.ctx.unbind()
        gc.unfreeze()
        gc.enable()

    def resume(self, ctx: ParallelContext) -> None:
        """Into the next incarnation (same rank and layout): its process groups and a new data source. The
        weights are the last incarnation's until a restore (or `reinitialize`) replaces them."""
        self.ctx.rebind(ctx)
        self.source = make_source(self.cfg, self.ctx, self.run_dir)
        self.step_index = 0
        self._freeze_gc()

    def reinitialize(self) -> None:
        """The weights and optimizer state of a new Trainer (the same random draws, so the same numbers), for
        a kept trainer whose job has nothing to restore: a new model is built aside and copied in, without an
        optimizer of its own (its state is several times the weights, and a kept one may fill most of a device)."""
        self.optimizer.reset_to(unique_named_parameters(shard_model(self._meta_model(), self.ctx, self.cfg)))
        self.step_index = 0

    def state_dict(self) -> dict:
        """The training progress a checkpoint carries (the optimizer and data source are parts of their own)."""
        return {"step": self.step_index}

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])


def checkpoint_parts(trainer: Trainer) -> dict:
    """What a checkpoint holds of a rank's training, by part name."""
    from megascale.checkpoint import RngState

    return {"train": trainer, "optimizer": trainer.optimizer, "data": trainer.source,
            "rng": RngState(trainer.ctx.device)}


class KeptTrainer:
    """The model and optimizer a rank process keeps across in-process restarts (control.restart: in_process,
    executor/rank.py): their allocations (on a GPU most of a rank's memory, and seconds of its start) outlive
    the incarnation that made them, and the next incarnation of the same rank, layout and training config
    restores into them instead of building anew. Anything else gets a new Trainer, and the kept one is freed
    first. The data source is made anew each incarnation: the node's loader is shared with ranks that may be
    new processes."""

    # The config sections a Trainer is built from; the others (checkpoint, control, ...) may change freely.
    SECTIONS = ("model", "parallelism", "batch", "optimizer", "precision", "data", "train", "eval")

    def __init__(self) -> None:
        self._trainer: Optional[Trainer] = None
        self._key: Optional[tuple] = None

    @classmethod
    def _key_of(cls, cfg: JobConfig, ctx: ParallelContext) -> tuple:
        sections = {name: value for name, value in cfg.to_dict().items() if name in cls.SECTIONS}
        return ctx.rank, ctx.layout, str(ctx.device), json.dumps(sections, sort_keys=True, default=str)

    def take(self, cfg: JobConfig, ctx: ParallelContext) -> Optional[Trainer]:
        """The kept trainer, resumed into `ctx`'s incarnation, if it fits `cfg` and `ctx`; else None."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return None
        if self._key != self._key_of(cfg, ctx):
            log.info("rank %d: the kept model does not fit this incarnation (another layout or config): "
                     "building anew", ctx.rank)
            trainer.close()
            return None
        try:
            trainer.resume(ctx)
        except BaseException:
            trainer.close()
            raise
        return trainer

    def keep(self, trainer: Trainer) -> None:
        """Keeps `trainer`, out of an incarnation that ended part-way, for the next one."""
        try:
            trainer.suspend()
        except BaseException:
            trainer.close()
            raise
        self._trainer, self._key = trainer, self._key_of(trainer.cfg, trainer.ctx)


def layout_of(cfg: JobConfig) -> Layout:
    p = cfg.parallelism
    return Layout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp)


def train_rank(ctx: ParallelContext, cfg: JobConfig, run_dir: str,
               on_step: Optional[Callable[[dict], None]] = None,
               on_start: Optional[Callable[[int], None]] = None,
               on_wait: Optional[Callable[[Optional[str]], None]] = None,
               kept: Optional[KeptTrainer] = None) -> Optional[dict]:
    """One rank's training loop. Every rank logs to rank-<R>.log (a line every train.log_every
    steps) and appends its step timings to timings-rank<R>.jsonl (the dashboard's heatmap); the
    reporting rank appends metrics.jsonl (with val_loss and val_ppl after a validation, eval.every)
    and calls `on_step(stats)`; TensorBoard and W&B logs go beside them (experiment_log.py).
    `on_start(step)` learns the step training starts from (a restored checkpoint's, else 0);
    `on_wait(what)` what training is blocked on outside a step (a checkpoint persisting, a validation), then
    `on_wait(None)`. Returns the last step's stats (None if it trained none): a job trains for weeks, and a
    history of every step kept in memory grew every rank by ~1 KB a step. With `kept` (an in-process restart)
    the rank trains on the model and optimizer a previous incarnation left there, if they fit, and leaves
    them there if this incarnation ends part-way."""
    from megascale.checkpoint import Checkpointer
    from megascale.evaluate import Evaluator, make_eval_source
    from megascale.experiment_log import ExperimentLog, check_wandb

    check_wandb(cfg)  # before anything is started that would need stopping
    # Whatever was started is closed however the loop ends: an in-process restart (executor/rank.py)
    # abandons it mid-step and trains on in the same process, which must not keep the gc frozen, a log
    # handler, open files or a keeper connection from the incarnation it left.
    with contextlib.ExitStack() as started:
        log_file = logging.FileHandler(Path(run_dir) / f"rank-{ctx.rank}.log")
        started.callback(log_file.close)
        log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("megascale").addHandler(log_file)
        started.callback(logging.getLogger("megascale").removeHandler, log_file)
        logging.getLogger("megascale").setLevel(logging.INFO)
        log.info("%s starting, %d steps", ctx.describe(), cfg.train.steps)
        eval_source = make_eval_source(cfg, ctx) if cfg.eval.every else None
        began = time.perf_counter()
        trainer = kept.take(cfg, ctx) if kept is not None else None
        reused = trainer is not None
        if reused:
            log.info("rank %d: training on the model and optimizer kept from the last incarnation (resumed in %.2f s: "
                     "groups bound, a new data source)", ctx.rank, time.perf_counter() - began)
        else:
            trainer = Trainer(cfg, ctx, run_dir=run_dir)

        def end_trainer(failed: Optional[type], *_: object) -> None:
            if kept is not None and failed is not None:
                kept.keep(trainer)  # abandoned part-way: the next incarnation restores into it
            else:
                trainer.close()

        started.push(end_trainer)
        ckpt = cfg.checkpoint
        checkpointer = Checkpointer(cfg, ctx, checkpoint_parts(trainer)) if ckpt.enabled else None
        restored = None
        if checkpointer:
            started.callback(checkpointer.close)
            if on_wait is not None:
                checkpointer.on_wait = on_wait
            if ckpt.resume:
                restored = checkpointer.restore()
            if ckpt.every:
                checkpointer.prepare()  # allocate the host buffer now, not in the first save
        if restored is None and reused:  # nothing to restore: start as a new model would
            trainer.reinitialize()
        if restored is None and ckpt.init_from:  # a fresh start from pretrained weights
            from megascale.interop import hf_dir_of, load_hf_weights

            load_hf_weights(trainer.optimizer, ctx, cfg.model, hf_dir_of(ckpt.init_from))
        if on_start is not None:
            on_start(trainer.step_index)
        if trainer.step_index >= cfg.train.steps and ctx.rank == 0:  # on the terminal, not only in the log
            print(f"nothing to train: resumed at step {trainer.step_index}, train.steps={cfg.train.steps} "
                  "(more with --steps N)", file=sys.stderr)
        reporter = ctx.tp.rank == 0 and ctx.dp.rank == 0 and ctx.is_last_stage
        evaluator = Evaluator(trainer, eval_source) if eval_source else None
        experiment = started.enter_context(contextlib.closing(ExperimentLog(cfg, ctx.rank, ctx.device, run_dir,
                                                                            reporter)))
        last = None
        metrics = started.enter_context(open(Path(run_dir) / "metrics.jsonl", "a")) if reporter else None
        timings_path = Path(run_dir) / f"timings-rank{ctx.rank}.jsonl"
        timings = started.enter_context(contextlib.closing(RollingWriter(timings_path, cfg.logging.jsonl_max_bytes())))
        while trainer.step_index < cfg.train.steps:
            stats = asdict(trainer.step())
            mfu = experiment.mfu(stats["tokens_per_s"])
            if mfu is not None:
                stats["mfu"] = mfu
            timings.write(json.dumps(stats["timings"]))
            if stats["step"] % cfg.train.log_every == 0:
                log.info("step %d loss %.4f grad_norm %.3f lr %.3g %.3fs %.0f tok/s", stats["step"], stats["loss"],
                         stats["grad_norm"], stats["lr"], stats["step_time"], stats["tokens_per_s"])
            if evaluator and evaluator.due(stats["step"]):
                if on_wait is not None:  # a validation can outlast many steps: not a hang (driver/recovery/hang.py)
                    on_wait(f"validation after step {stats['step']}")
                stats.update(evaluator.evaluate())
                if on_wait is not None:
                    on_wait(None)
                log.info("step %d val_loss %.4f val_ppl %.2f (%.2fs)", stats["step"], stats["val_loss"],
                         stats["val_ppl"], stats["val_time"])
            last = stats
            experiment.record(stats)
            if reporter:
                metrics.write(json.dumps(stats) + "\n")
                metrics.flush()
                if on_step is not None:
                    on_step(stats)
            if checkpointer:
                checkpointer.after_step(trainer.step_index)
        if checkpointer:
            checkpointer.flush()  # the last checkpoint commits before the job reports success
        trainer.finish()
    return last
