"""Standard experiment logs beside metrics.jsonl: TensorBoard event files, and Weights & Biases offline.

    <run_dir>/tensorboard/job      the job's scalars, from the rank that writes metrics.jsonl: loss, val_loss,
                                   val_ppl, lr, grad_norm, tokens_per_s, mfu
    <run_dir>/tensorboard/rank-R   rank R's own step time, written by rank R: one writer per rank costs no
                                   collective on the step's path, and TensorBoard overlays the ranks' runs
                                   on one chart, so a straggler stands out
    <run_dir>/wandb                the job's scalars for `wandb sync` (logging.wandb)

`tensorboard --logdir <run_dir>/tensorboard` shows them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import torch

from megascale.config import ConfigError, JobConfig

# bf16 dense peak FLOP/s per GPU, by a word of torch.cuda.get_device_name(); others need logging.peak_tflops.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
FLUSH_S = 10
JOB_SCALARS = ("loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s", "mfu")


def check_wandb(cfg: JobConfig) -> None:
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb: true needs the wandb package (pip install wandb), "
                          "or set logging.wandb: false")


def peak_flops(cfg: JobConfig, device: torch.device) -> Optional[float]:
    """One device's peak FLOP/s: logging.peak_tflops, else a known GPU's; None when unknown (no MFU)."""
    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for word, tflops in PEAK_TFLOPS.items():
            if word in name:
                return tflops * 1e12
    return None


def model_flops_per_token(cfg: JobConfig) -> int:
    from megascale.model.gpt import GPT

    with torch.device("meta"):  # only the config is read: no weights are made
        return GPT(cfg.model).num_flops_per_token()


class ExperimentLog:
    """One per rank; `record(stats)` after each step with train_rank's stats (val_* on validation steps)."""

    def __init__(self, cfg: JobConfig, rank: int, device: torch.device, run_dir: str | Path, reporter: bool):
        self.rank, self.reporter = rank, reporter
        self.rank_writer = self.job_writer = self.wandb = None
        peak = peak_flops(cfg, device)
        # MFU: model FLOPs done per second by the job over what its devices could do at peak.
        self.mfu_scale = (model_flops_per_token(cfg) / (peak * cfg.parallelism.world_size)) if peak else None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            root = Path(run_dir) / "tensorboard"
            # Flushed every FLUSH_S (TensorBoard's default is 2 minutes): a running job's charts stay current.
            self.rank_writer = SummaryWriter(str(root / f"rank-{rank}"), flush_secs=FLUSH_S)
            if reporter:
                self.job_writer = SummaryWriter(str(root / "job"), flush_secs=FLUSH_S)
        if cfg.logging.wandb and reporter:
            import wandb  # train_rank checked it is there (check_wandb)

            self.wandb = wandb.init(project="megascale", name=Path(run_dir).name, dir=str(run_dir),
                                    mode="offline", config=cfg.to_dict())

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        return None if self.mfu_scale is None else tokens_per_s * self.mfu_scale

    def record(self, stats: dict) -> None:
        step = stats["step"]
        if self.rank_writer is not None:
            self.rank_writer.add_scalar("step_time", stats["step_time"], step)
        if not self.reporter:
            return
        scalars = {name: stats[name] for name in JOB_SCALARS if stats.get(name) is not None}
        if self.job_writer is not None:
            for name, value in scalars.items():
                self.job_writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        for writer in (self.rank_writer, self.job_writer):
            if writer is not None:
                writer.close()
        if self.wandb is not None:
            self.wandb.finish()
