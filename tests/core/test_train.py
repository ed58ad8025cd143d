"""The training loop: synchronised GC, mixed precision, timers, learning-rate schedule."""
from __future__ import annotations

import gc

import pytest
import torch

from megascale.config import from_dict
from megascale.parallel.topology import single_device_context
from megascale.timers import SEGMENTS
from megascale.train import Trainer, learning_rate

TINY = {"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "batch": {"micro": 2, "global": 4}}


def tiny(**overrides):
    raw = {k: dict(v) for k, v in TINY.items()}
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return from_dict(raw)


def test_gc_runs_only_at_the_configured_step_interval(monkeypatch):
    collected = []
    trainer = Trainer(tiny(train={"gc_every": 3, "steps": 7}), single_device_context())
    try:
        assert not gc.isenabled()  # taken off the automatic schedule
        monkeypatch.setattr(gc, "collect", lambda *a: collected.append(trainer.step_index))
        for _ in range(7):
            trainer.step()
    finally:
        trainer.close()
    assert collected == [3, 6]
    assert gc.isenabled()


def test_bf16_compute_keeps_fp32_master_weights_and_tracks_fp32_loss():
    fp32 = Trainer(tiny(), single_device_context())
    bf16 = Trainer(tiny(precision={"dtype": "bf16"}), single_device_context())
    try:
        assert next(bf16.chunks[0].parameters()).dtype == torch.bfloat16
        assert bf16.optimizer.master.dtype == torch.float32
        losses = [(a.step().loss, b.step().loss) for a, b in ((fp32, bf16),) * 3]
    finally:
        fp32.close()
        bf16.close()
    for full, half in losses:
        assert half == pytest.approx(full, rel=2e-2)


def test_every_step_reports_all_timer_segments():
    trainer = Trainer(tiny(), single_device_context())
    try:
        stats = trainer.step()
    finally:
        trainer.close()
    segments = stats.timings["segments"]
    assert set(segments) == set(SEGMENTS)
    assert segments["forward"] > 0 and segments["backward"] > 0 and segments["optimizer"] > 0
    assert stats.timings["total"] >= segments["forward"] + segments["backward"]


@pytest.mark.parametrize("kind, at_end", [("constant", 1.0), ("cosine", 0.1), ("linear", 0.1)])
def test_learning_rate_warms_up_then_decays(kind, at_end):
    cfg = tiny(optimizer={"lr": 1.0, "schedule": {"kind": kind, "warmup_steps": 4, "min_lr_ratio": 0.1}},
               train={"steps": 20})
    assert [learning_rate(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(cfg, 20) == pytest.approx(at_end)


def test_loss_decreases_on_the_learnable_synthetic_data():
    trainer = Trainer(tiny(optimizer={"name": "adamw", "lr": 0.01}), single_device_context())
    try:
        losses = [trainer.step().loss for _ in range(30)]
    finally:
        trainer.close()
    assert losses[-1] < losses[0] - 0.5


def _gathers_in_flight(ctx, cfg) -> tuple[int, int]:
    trainer = Trainer(cfg, ctx)
    trainer.step()
    before = len(trainer.optimizer._gathers)
    trainer.finish()
    after = len(trainer.optimizer._gathers)
    trainer.close()
    return before, after


def test_finish_leaves_no_collective_in_flight_for_the_process_group_teardown():
    """With overlap, each step ends with the next step's parameter all-gathers running; a rank that
    destroyed its process group under them aborted at exit now and then (a job's last step)."""
    from megascale.launch import run_ranks
    from megascale.parallel.topology import Layout

    cfg = tiny(parallelism={"dp": 2})
    for before, after in run_ranks(_gathers_in_flight, Layout(dp=2), cfg):
        assert before > 0 and after == 0
