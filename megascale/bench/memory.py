"""`megascale bench memory`: bytes per rank, of activations under each `train.recompute` mode and
of gradients under ZeRO-1 and ZeRO-2, plus what recomputation costs in step time.

Activations (one rank): on a GPU the peak of `torch.cuda.max_memory_allocated` through a step's
forward and backward above what was allocated before it; on the CPU the unique storages of the
tensors forward saves for backward (`saved_tensors_hooks`) plus the inputs a recomputed module
keeps to run again, parameters and buffers left out, their bytes read when the forward ends. Each
mode is measured with the attention kernel the engine picks and again with SDPA's math kernel,
which stores the seq x seq scores. Gradients: the engine's own accounting (grad_buffers.py),
measured after real steps of two microbatches on dp ranks.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.attention import SDPBackend, sdpa_kernel

from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.parallel.parallelize import unique_named_parameters
from megascale.parallel.recompute import recomputed_modules
from megascale.parallel.topology import ParallelContext, single_device_context
from megascale.train import Trainer, layout_of

MODES = ("none", "selective", "full")


def memory_job(quick: bool, recompute: str = "none", dp: int = 1, zero: int = 2, seq: int | None = None) -> JobConfig:
    return from_dict({
        "model": {"layers": 4, "hidden": 128 if quick else 512, "heads": 8, "ffn": 512 if quick else 2048,
                  "vocab": 2048, "seq": seq or (128 if quick else 512)},
        "parallelism": {"dp": dp, "zero": zero, "grad_bucket_mb": 0.25 if quick else 4.0},
        "batch": {"micro": 2, "global": 2 * dp},
        "train": {"recompute": recompute},
    })


class SavedActivations:
    """Unique storages of what forward keeps for backward, weights and buffers excluded, counted
    when the forward ends: `selective` frees its norm and activation outputs after each block's
    forward, while the tensors saved of them stay (empty) until backward refills them."""

    def __init__(self, chunks: list[nn.Module], recompute: str):
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.excluded = {t.untyped_storage().data_ptr() for chunk in chunks
                         for t in [*chunk.parameters(), *chunk.buffers()]}
        self.hooks = [module.register_forward_pre_hook(self._keep_inputs)
                      for module in recomputed_modules(chunks, recompute)]
        self.hooks.append(chunks[-1].register_forward_hook(self._forward_ended))
        self.at_forward_end = 0

    def _record(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.storages[storage.data_ptr()] = storage

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t

    def _keep_inputs(self, _module: nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._record(a)

    def _forward_ended(self, *_) -> None:
        self.at_forward_end = sum(storage.nbytes() for storage in self.storages.values())

    def step(self, trainer: Trainer) -> int:
        """Saved-activation bytes of one training step (one microbatch: all of it alive at once)."""
        self.storages.clear()
        with saved_tensors_hooks(self._pack, lambda t: t):
            trainer.step()
        for hook in self.hooks:
            hook.remove()
        self.storages.clear()
        return self.at_forward_end


def activation_bytes(trainer: Trainer, recompute: str) -> int:
    """Activation bytes of one step of `trainer` (whose `train.recompute` is `recompute`)."""
    if trainer.ctx.device.type == "cuda":
        # The peak through forward and backward, read where the optimizer starts (its temporaries
        # are the same under every mode).
        peak, sync = {}, trainer.optimizer.finish_grad_sync

        def sync_after_backward() -> None:
            peak["bytes"] = torch.cuda.max_memory_allocated()
            sync()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.optimizer.finish_grad_sync = sync_after_backward
        try:
            trainer.step()
        finally:
            del trainer.optimizer.finish_grad_sync  # the class's method again
        return peak["bytes"] - before
    return SavedActivations(trainer.chunks, recompute).step(trainer)


def _step_seconds(trainer: Trainer) -> float:
    """Seconds of one step: wall time on a GPU; on the CPU this process's CPU time with one
    intra-op thread, which other processes on a shared machine slow far less than the wall clock
    (and no thread spins at a barrier waiting for a core another process holds)."""
    if trainer.ctx.device.type == "cuda":
        return trainer.step().step_time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.process_time()
    trainer.step()
    seconds = time.process_time() - started
    torch.set_num_threads(threads)
    return seconds


def one_rank(quick: bool, rounds: int) -> dict:
    """Activation bytes and step time of each recompute mode. The modes' steps take turns and each
    keeps its fastest: the step least disturbed by anything else."""
    device = torch.device("cuda") if torch.cuda.is_available() else None
    trainers = {mode: Trainer(memory_job(quick, mode), single_device_context(device)) for mode in MODES}
    activations, math_attention, times = {}, {}, {mode: [] for mode in MODES}
    for mode, trainer in trainers.items():
        trainer.step()  # warm-up: allocator, kernels
        activations[mode] = activation_bytes(trainer, mode)
        # What selective recomputation is for: an attention kernel that stores its score matrix.
        with sdpa_kernel(SDPBackend.MATH):
            math_attention[mode] = activation_bytes(trainer, mode)
    for _ in range(rounds):
        for mode, trainer in trainers.items():
            times[mode].append(_step_seconds(trainer))
    chunks = trainers["none"].chunks
    for trainer in trainers.values():
        trainer.finish()
        trainer.close()
    return {"activation_bytes": activations, "activation_bytes_math_attention": math_attention,
            "param_bytes": sum(p.numel() * p.element_size() for _, p in unique_named_parameters(chunks)),
            "recompute_step_time_ratio": {mode: min(times[mode]) / min(times["none"]) for mode in MODES[1:]}}


def _rank_gradient_bytes(ctx: ParallelContext, cfg: JobConfig) -> dict:
    trainer = Trainer(cfg, ctx)
    for _ in range(2):
        trainer.step()
    trainer.finish()
    trainer.close()
    opt = trainer.optimizer
    return {"grad_bytes": opt.gradients.nbytes, "full_grad_bytes": sum(b.size for b in opt.buckets) * 4,
            "bucket_bytes": max(b.size for b in opt.buckets) * 4,
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in (opt.master, opt.exp_avg,
                                                                                  opt.exp_avg_sq))}


def gradients(quick: bool, dps: tuple[int, ...] = (2, 4)) -> dict:
    grad, state, full, bucket = {}, {}, 0, 0
    for dp in dps:
        for zero in (1, 2):
            cfg = memory_job(quick, dp=dp, zero=zero, seq=64)
            ranks = run_ranks(_rank_gradient_bytes, layout_of(cfg), cfg)
            grad[f"zero{zero}_dp{dp}"] = max(r["grad_bytes"] for r in ranks)
            state[f"dp{dp}"] = max(r["optimizer_state_bytes"] for r in ranks)
            full, bucket = ranks[0]["full_grad_bytes"], ranks[0]["bucket_bytes"]
    goal = {name: grad[name] <= full / int(name.rpartition("dp")[2]) + 2 * bucket for name in grad if "zero2" in name}
    return {"grad_bytes_per_rank": grad, "full_grad_bytes": full, "bucket_bytes": bucket,
            "optimizer_state_bytes_per_rank": state, "zero2_within_goal": goal}


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    report = one_rank(args.quick, 3 if args.quick else 6)
    report |= gradients(args.quick)
    a = report["activation_bytes"]
    report["activation_reduction"] = {mode: a["none"] / a[mode] for mode in MODES[1:]}
    a = report["activation_bytes_math_attention"]
    report["activation_reduction_math_attention"] = {mode: a["none"] / a[mode] for mode in MODES[1:]}
    report["model"] = "gpt 4 layers, hidden {hidden}, heads 8, seq {seq}, micro 2 (fp32)".format(
        **vars(memory_job(args.quick).model))
    report["device"] = ("cuda (max_memory_allocated, wall time)" if torch.cuda.is_available()
                        else "cpu (saved tensors, process CPU time)")
    report["seconds"] = time.perf_counter() - started
    return report
