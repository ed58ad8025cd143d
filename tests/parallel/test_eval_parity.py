"""Validation loss at 8 ranks (tp2 sp, pp2 interleaved, dp2) equals 1 rank's (helpers: parity_support.py)."""
from __future__ import annotations

import dataclasses

import pytest

from megascale.config import EvalConfig
from megascale.evaluate import Evaluator, make_eval_source
from megascale.launch import run_ranks
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer, layout_of
from parity_support import job


def _validate(ctx, cfg):
    """val_loss of the initial weights, then after one training step (the weights moved)."""
    trainer = Trainer(cfg, ctx)
    evaluator = Evaluator(trainer, make_eval_source(cfg, ctx))
    losses = [evaluator.evaluate()["val_loss"]]
    trainer.step()
    losses.append(evaluator.evaluate()["val_loss"])
    trainer.finish()
    trainer.close()
    return losses


def test_val_loss_at_eight_ranks_equals_one_rank():
    cfg = job({"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "sequence_parallel": True}, global_batch=8)
    cfg = dataclasses.replace(cfg, eval=EvalConfig(every=1, steps=2))
    one = dataclasses.replace(cfg, parallelism=dataclasses.replace(
        cfg.parallelism, tp=1, pp=1, dp=1, vpp=1, sequence_parallel=False))
    expected = _validate(single_device_context(), one)
    assert expected[0] != expected[1]  # the second validation sees trained weights
    for rank, got in enumerate(run_ranks(_validate, layout_of(cfg), cfg, sequence_parallel=True)):
        assert got == pytest.approx(expected, rel=1e-5), f"rank {rank}"
