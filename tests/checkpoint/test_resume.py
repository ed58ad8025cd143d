"""Interrupt and resume: train S steps with a checkpoint at S/2, kill every rank, resume; the
losses after resume equal the uninterrupted run's bit for bit (fp32, CPU). Also: ranks killed
while their keepers still persist the checkpoint resume from it, not from the one before."""
from __future__ import annotations

import collections
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from megascale.checkpoint import Checkpointer, RngState, shutdown_keeper
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.train import Trainer

STEPS, SAVE_AT = 4, 2


def checkpointer_of(trainer: Trainer) -> Checkpointer:
    parts = {"train": trainer, "optimizer": trainer.optimizer, "data": trainer.source,
             "rng": RngState(trainer.ctx.device)}
    return Checkpointer(trainer.cfg, trainer.ctx, parts)


def train_then_crash(ctx, cfg, out: str) -> None:
    trainer = Trainer(cfg, ctx)
    checkpointer = checkpointer_of(trainer)
    checkpointer.prepare()
    losses = []
    for _ in range(STEPS):
        losses.append(trainer.step().loss)
        checkpointer.after_step(trainer.step_index)  # resolves the persist while training goes on
        if trainer.step_index == SAVE_AT:
            checkpointer.save(trainer.step_index)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps(losses))
    assert checkpointer.flush() == SAVE_AT  # committed before the crash, so the test is deterministic
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: the keeper just sees the connection drop


def crash_while_persisting(ctx, cfg, out: str) -> None:
    """Saves at SAVE_AT (the instrumented storage writes slowly), trains on, dies before the commit."""
    trainer = Trainer(cfg, ctx)
    checkpointer = checkpointer_of(trainer)
    checkpointer.prepare()
    losses = [trainer.step().loss for _ in range(SAVE_AT)]
    checkpointer.save(trainer.step_index)
    losses += [trainer.step().loss for _ in range(SAVE_AT, STEPS)]
    if ctx.rank == 0:
        Path(out).write_text(json.dumps(losses))
    os.kill(os.getpid(), signal.SIGKILL)


def resume(ctx, cfg) -> dict:
    trainer = Trainer(cfg, ctx)
    checkpointer = checkpointer_of(trainer)
    start = checkpointer.restore()
    losses = [trainer.step().loss for _ in range(start or 0, STEPS)]
    checkpointer.close()
    trainer.close()
    return {"start": start, "losses": losses, "bytes_read": checkpointer.bytes_read,
            "from": checkpointer.restored_from}


def interrupt_and_resume(job, root: Path, parallelism: dict, resume_parallelism: dict | None = None,
                         from_memory: bool = True) -> tuple[list[float], list[dict]]:
    cfg = job(str(root), parallelism, steps=STEPS)
    out = root.parent / "losses.json"
    with pytest.raises(RuntimeError, match="without a result"):
        run_ranks(train_then_crash, layout_of(cfg), cfg, str(out),
                  sequence_parallel=cfg.parallelism.sequence_parallel)
    if not from_memory:
        assert shutdown_keeper(str(root)) is not None  # as if the node had been replaced
    Path(f"{root}.reads").unlink(missing_ok=True)
    cfg = job(str(root), resume_parallelism or parallelism, steps=STEPS)
    results = run_ranks(resume, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel)
    assert all(r["start"] == SAVE_AT for r in results)
    return json.loads(out.read_text()), results


def shard_reads(fs, root: Path) -> collections.Counter:
    return collections.Counter(name for name, _ in fs.reads(root) if name.endswith(".safetensors"))


def assert_exact(expected: list[float], results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["losses"] == expected[SAVE_AT:], f"rank {rank}"


def test_dp2_resumes_exactly_from_host_memory(ckpt_dir, make_job, fs):
    expected, results = interrupt_and_resume(make_job, ckpt_dir, {"dp": 2})
    assert_exact(expected, results)
    assert shard_reads(fs, ckpt_dir) == {}  # not one shard byte from storage
    assert all(r["bytes_read"] == 0 and r["from"] == {"host memory": 1} for r in results)


def test_tp2_resumes_exactly_from_storage(ckpt_dir, make_job, fs):
    expected, results = interrupt_and_resume(make_job, ckpt_dir, {"tp": 2}, from_memory=False)
    assert_exact(expected, results)
    assert shard_reads(fs, ckpt_dir) == {"pp0-tp0-dp0.safetensors": 1, "pp0-tp1-dp0.safetensors": 1}
    # What restoring onto another layout needs: each sharded parameter's full shape, TP split, and stage.
    manifest = json.loads((ckpt_dir / f"step-{SAVE_AT:08d}" / "manifest.json").read_text())
    assert manifest["parts"] == ["train", "optimizer", "data", "rng"]
    params = manifest["tensors"]["optimizer.shard"]
    assert params["blocks.0.ln.weight"] == {"shape": [32], "split": None, "pp": [0]}
    qkv = params["blocks.0.attn.qkv.weight"]
    assert qkv == {"shape": [96, 32], "split": {"dim": 0, "parts": 2, "sections": [32, 32, 32]}, "pp": [0]}


def test_pp2_vpp2_resumes_exactly(ckpt_dir, make_job, fs):
    expected, results = interrupt_and_resume(make_job, ckpt_dir, {"pp": 2, "vpp": 2})
    assert_exact(expected, results)
    manifest = json.loads((ckpt_dir / f"step-{SAVE_AT:08d}" / "manifest.json").read_text())
    holders = {name: p["pp"] for name, p in manifest["tensors"]["optimizer.shard"].items()}
    assert holders["wte.weight"] == [0] and holders["blocks.3.ln.weight"] == [1] and len(holders) == 28


def test_dp4_checkpoint_resumes_on_dp2(ckpt_dir, make_job, fs):
    expected, results = interrupt_and_resume(make_job, ckpt_dir, {"dp": 4}, {"dp": 2})
    for r in results:
        torch.testing.assert_close(r["losses"], expected[SAVE_AT:], rtol=1e-5, atol=0)
    # Ranks 0 and 1 still hold old shards dp0 and dp1 in memory; dp2 and dp3 are read once each
    # (by one member of the DP group) and broadcast.
    assert shard_reads(fs, ckpt_dir) == {"pp0-tp0-dp2.safetensors": 1, "pp0-tp0-dp3.safetensors": 1}


@pytest.mark.slow
def test_eight_ranks_tp2_pp2_dp2_vpp2_sp_resume_exactly_from_storage(ckpt_dir, make_job, fs):
    parallelism = {"tp": 2, "pp": 2, "dp": 2, "vpp": 2, "sequence_parallel": True}
    expected, results = interrupt_and_resume(make_job, ckpt_dir, parallelism, from_memory=False)
    assert_exact(expected, results)
    reads = shard_reads(fs, ckpt_dir)
    assert len(reads) == 8 and set(reads.values()) == {1}  # each shard once, for its DP group


def test_ranks_killed_mid_persist_resume_from_that_checkpoint_in_host_memory(ckpt_dir, make_job, fs):
    cfg = make_job(str(ckpt_dir), {"dp": 2}, steps=STEPS)
    fs.set_options(ckpt_dir, delay_s=3)  # the keepers are still writing when the ranks die
    out = ckpt_dir.parent / "losses.json"
    with pytest.raises(RuntimeError, match="without a result"):
        run_ranks(crash_while_persisting, layout_of(cfg), cfg, str(out))
    assert not list(ckpt_dir.glob("*/manifest.json"))  # nothing committed when they died
    results = run_ranks(resume, layout_of(cfg), cfg)
    assert [r["start"] for r in results] == [SAVE_AT, SAVE_AT]
    assert_exact(json.loads(out.read_text()), results)
    assert all(r["bytes_read"] == 0 and r["from"] == {"host memory": 1} for r in results)
    assert (ckpt_dir / f"step-{SAVE_AT:08d}" / "manifest.json").exists()
