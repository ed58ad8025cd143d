"""Damaged shards, a full disk and a persister killed mid-write: training goes on, nothing
half-written is ever committed, restore falls back to the previous committed checkpoint."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from megascale.checkpoint import (
    Checkpointer, CheckpointError, RngState, committed_steps, open_storage, shutdown_keeper,
)
from megascale.parallel.topology import single_device_context
from megascale.train import Trainer


def start(cfg) -> tuple[Trainer, Checkpointer]:
    trainer = Trainer(cfg, single_device_context())
    parts = {"train": trainer, "optimizer": trainer.optimizer, "data": trainer.source,
             "rng": RngState(trainer.ctx.device)}
    return trainer, Checkpointer(cfg, trainer.ctx, parts)


def committed(root) -> list[int]:
    return committed_steps(open_storage(str(root)))


def shard(root, step: int):
    return root / f"step-{step:08d}" / "pp0-tp0-dp0.safetensors"


def resumed_losses(cfg, expect_step: int, steps: int = 2) -> list[float]:
    trainer, checkpointer = start(cfg)
    assert checkpointer.restore() == expect_step
    losses = [trainer.step().loss for _ in range(steps)]
    checkpointer.close()
    return losses


def test_corrupt_and_truncated_shards_fall_back_to_older_checkpoints(ckpt_dir, make_job, caplog):
    cfg = make_job(str(ckpt_dir), steps=6)
    trainer, checkpointer = start(cfg)
    losses = []
    for _ in range(6):
        losses.append(trainer.step().loss)
        if trainer.step_index % 2 == 0:
            checkpointer.save(trainer.step_index)
            assert checkpointer.flush() == trainer.step_index
    checkpointer.close()
    assert committed(ckpt_dir) == [2, 4, 6]
    data = bytearray(shard(ckpt_dir, 6).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the tensor data
    shard(ckpt_dir, 6).write_bytes(data)
    with open(shard(ckpt_dir, 4), "r+b") as f:
        f.truncate(1000)
    shutdown_keeper(str(ckpt_dir))  # its host snapshot of step 6 is intact: force storage
    with caplog.at_level(logging.INFO, logger="megascale.checkpoint"):
        assert resumed_losses(cfg, 2) == losses[2:4]
    assert "checksum crc32" in caplog.text and "(corrupted)" in caplog.text
    assert "truncated" in caplog.text
    assert "falling back to the previous committed one" in caplog.text

    shard(ckpt_dir, 2).write_bytes(b"\0" * 64)
    trainer, checkpointer = start(cfg)
    with pytest.raises(CheckpointError, match="none of the 3 committed checkpoints could be restored"):
        checkpointer.restore()


def test_full_disk_reports_the_error_and_commits_nothing(ckpt_dir, make_job, fs, caplog):
    cfg = make_job(str(ckpt_dir), steps=6, every=2)
    trainer, checkpointer = start(cfg)
    checkpointer.prepare()
    losses = []
    with caplog.at_level(logging.INFO, logger="megascale.checkpoint"):
        for _ in range(6):
            losses.append(trainer.step().loss)
            checkpointer.after_step(trainer.step_index)  # saves at steps 2, 4 and 6
            if trainer.step_index == 2:
                assert checkpointer.flush() == 2
                fs.set_options(ckpt_dir, full=True)
        assert checkpointer.flush() == 2
    assert len(losses) == 6  # training went on
    assert sorted(checkpointer.failures) == [4, 6]
    assert all("No space left on device" in e for e in checkpointer.failures.values())
    assert "checkpoint step 4 NOT committed" in caplog.text and "checkpoint step 6 NOT committed" in caplog.text
    assert committed(ckpt_dir) == [2]
    assert not (ckpt_dir / "step-00000004" / "manifest.json").exists()
    checkpointer.close()
    # The keeper's memory now holds the failed step 6, which matches no manifest: storage it is.
    assert resumed_losses(cfg, 2) == losses[2:4]


def test_persister_killed_mid_write_keeps_the_previous_checkpoint(ckpt_dir, make_job, fs, caplog):
    cfg = make_job(str(ckpt_dir), steps=6)
    trainer, checkpointer = start(cfg)
    checkpointer.prepare()
    losses = []
    for _ in range(6):
        losses.append(trainer.step().loss)
        checkpointer.after_step(trainer.step_index)
        if trainer.step_index == 2:
            checkpointer.save(trainer.step_index)
            assert checkpointer.flush() == 2
        if trainer.step_index == 4:
            fs.set_options(ckpt_dir, delay_s=60)  # the next write hangs ...
            checkpointer.save(trainer.step_index)
            deadline = time.monotonic() + 30
            while not shard(ckpt_dir, 4).exists():  # ... once the keeper has started writing
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(checkpointer.link.pid, signal.SIGKILL)
            fs.set_options(ckpt_dir)
    with caplog.at_level(logging.ERROR, logger="megascale.checkpoint"):
        assert checkpointer.flush() == 2
    assert "checkpoint step 4 not persisted" in caplog.text and "is gone" in caplog.text
    assert committed(ckpt_dir) == [2] and not (ckpt_dir / "step-00000004" / "manifest.json").exists()
    assert resumed_losses(cfg, 2) == losses[2:4]  # the previous checkpoint is intact
    # Training went on; the next checkpoint starts a new keeper, commits, and clears the debris.
    checkpointer.save(trainer.step_index)
    assert checkpointer.flush() == 6
    assert committed(ckpt_dir) == [2, 6] and not (ckpt_dir / "step-00000004").exists()
    checkpointer.close()


@pytest.mark.parametrize("when_busy", ["wait", "skip"])
def test_storage_slower_than_checkpoint_every_waits_or_skips_as_configured(ckpt_dir, make_job, fs, when_busy):
    """Each write takes 0.6 s, a save is due every step (~0.05 s): `wait` stalls training on every save and
    commits them all; `skip` trains on, skips saves while one persists, and still saves the last step."""
    cfg = make_job(str(ckpt_dir), steps=6, every=1, keep=10, when_busy=when_busy)
    fs.set_options(ckpt_dir, delay_s=0.6)
    trainer, checkpointer = start(cfg)
    checkpointer.prepare()
    began = time.monotonic()
    for _ in range(cfg.train.steps):
        trainer.step()
        checkpointer.after_step(trainer.step_index)
    trained_s = time.monotonic() - began
    assert checkpointer.flush() == 6
    checkpointer.close()
    if when_busy == "wait":
        assert checkpointer.skipped == [] and committed(ckpt_dir) == [1, 2, 3, 4, 5, 6]
        assert trained_s > 5 * 0.6  # every save after the first waited out a write
    else:
        assert checkpointer.skipped and 6 not in checkpointer.skipped
        assert committed(ckpt_dir) == sorted(set(range(1, 7)) - set(checkpointer.skipped))
        assert max(checkpointer.stalls[:-1]) < 0.3  # only the last step's save waits
