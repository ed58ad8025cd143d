"""N ranks vs 1 rank: same initial weights and data, several optimizer steps.

Tolerances: per-step loss and grad norm within 1e-5 relative, final weights within 1e-4 absolute.
"""
from __future__ import annotations

import dataclasses

import torch

from megascale.config import JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.parallel.state import full_stage_parameters
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer, layout_of

STEPS = 3


def job(parallelism: dict, block: str = "serial", window=None, optimizer: str = "lamb", tied: bool = False,
        global_batch: int = 8, micro: int = 1, layers: int = 4, overlap: bool | None = None, arch: str = "gpt",
        kv_heads: int | None = None) -> JobConfig:
    if overlap is not None:  # every overlap switch on, or every one off
        parallelism = {**parallelism, "overlap": {"tp": overlap, "pp": overlap, "dp": overlap}}
    return from_dict({
        "model": {"arch": arch, "layers": layers, "hidden": 64, "heads": 4, "kv_heads": kv_heads, "ffn": 128,
                  "vocab": 128, "seq": 32, "block": block, "window": window, "tied_embeddings": tied},
        "parallelism": parallelism,
        "batch": {"micro": micro, "global": global_batch},
        "optimizer": {"name": optimizer, "lr": 0.01, "schedule": {"kind": "constant"}},
        "train": {"steps": STEPS},
    })


def _train(ctx, cfg):
    trainer = Trainer(cfg, ctx)
    stats = [trainer.step() for _ in range(STEPS)]
    trainer.finish()
    params = full_stage_parameters(trainer.chunks, ctx)
    trainer.close()  # stops a data loader process, re-enables gc
    return {"loss": [s.loss for s in stats], "grad_norm": [s.grad_norm for s in stats], "params": params}


def single_rank(cfg):
    one = dataclasses.replace(cfg, parallelism=dataclasses.replace(
        cfg.parallelism, tp=1, pp=1, dp=1, vpp=1, sequence_parallel=False))
    return _train(single_device_context(), one)


def assert_parity(cfg):
    expected = single_rank(cfg)
    results = run_ranks(_train, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=0, msg=f"rank {rank} loss")
        torch.testing.assert_close(got["grad_norm"], expected["grad_norm"], rtol=1e-5, atol=1e-7,
                                   msg=f"rank {rank} grad norm")
        for name, value in got["params"].items():
            reference = expected["params"].get(name, expected["params"].get("wte.weight"))  # tied copy
            torch.testing.assert_close(value, reference, rtol=0, atol=1e-4, msg=f"rank {rank} {name}")
    # Every parameter of the 1-rank model lives on some stage.
    seen = set().union(*(r["params"] for r in results))
    assert set(expected["params"]) <= seen
    # Training moved the weights: the comparison above is not of untouched initial values.
    assert expected["loss"][0] != expected["loss"][-1]
