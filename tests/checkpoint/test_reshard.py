"""Resuming on another layout: a run saves at step SAVE_AT and continues to STEPS; runs resumed from
that checkpoint with other tp / pp / vpp / dp reach the same losses (within 1e-5 relative: the sums
are ordered differently), with each rank's random streams those of the old rank it took over.
A layout that cannot work, or another model, is refused in one line before any rank starts."""
from __future__ import annotations

import zlib

import pytest
import torch
import yaml

from megascale.checkpoint import Checkpointer, RngState
from megascale.checkpoint.storage import new_manifest, open_storage, write_manifest
from megascale.cli import main
from megascale.config import from_dict
from megascale.launch import run_ranks
from megascale.train import Trainer, layout_of

SAVE_AT, STEPS = 4, 6
GPT_TIED = {"arch": "gpt", "block": "parallel", "tied_embeddings": True}
LLAMA_GQA = {"arch": "llama", "kv_heads": 2}


def job_dict(uri: str, model: dict, optimizer: str, parallelism: dict) -> dict:
    return {
        "model": {"layers": 4, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64, "seq": 16, **model},
        "parallelism": parallelism,
        "batch": {"micro": 1, "global": 8},
        "optimizer": {"name": optimizer, "lr": 0.02, "schedule": {"kind": "cosine", "warmup_steps": 1}},
        "checkpoint": {"uri": uri, "every": SAVE_AT, "keeper_idle_s": 120, "memory_every": 0},
        "train": {"steps": STEPS},
    }


def job(uri: str, model: dict, optimizer: str, parallelism: dict):
    return from_dict(job_dict(uri, model, optimizer, parallelism))


def checkpointer_of(trainer: Trainer) -> Checkpointer:
    parts = {"train": trainer, "optimizer": trainer.optimizer, "data": trainer.source,
             "rng": RngState(trainer.ctx.device)}
    return Checkpointer(trainer.cfg, trainer.ctx, parts)


def rng_digest() -> int:
    return zlib.crc32(torch.get_rng_state().numpy().tobytes())


def train_and_save(ctx, cfg) -> dict:
    torch.manual_seed(1000 + ctx.rank)  # every rank's streams differ: which one a rank resumes shows
    trainer = Trainer(cfg, ctx)
    checkpointer = checkpointer_of(trainer)
    checkpointer.prepare()
    losses, rng = [], None
    while trainer.step_index < STEPS:
        losses.append(trainer.step().loss)
        if trainer.step_index == SAVE_AT:
            rng = rng_digest()
        checkpointer.after_step(trainer.step_index)
    assert checkpointer.flush() == SAVE_AT
    checkpointer.close()
    trainer.finish()
    trainer.close()
    return {"losses": losses, "rng": rng, "coords": [ctx.pp.rank, ctx.tp.rank, ctx.dp.rank]}


def resume(ctx, cfg) -> dict:
    torch.manual_seed(7)
    trainer = Trainer(cfg, ctx)
    checkpointer = checkpointer_of(trainer)
    assert checkpointer.restore() == SAVE_AT
    sources = checkpointer.reader.sources
    took = list(sources.coords[sources.own])
    rng = rng_digest()
    losses = [trainer.step().loss for _ in range(SAVE_AT, STEPS)]
    checkpointer.close()
    trainer.finish()
    trainer.close()
    return {"losses": losses, "rng": rng, "took": took, "from": checkpointer.restored_from}


def run(cfg, fn):
    return run_ranks(fn, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel)


def assert_resumes_on(ckpt_dir, model: dict, optimizer: str, saved_on: dict, layouts: list[dict]) -> list[list[dict]]:
    original = run(job(str(ckpt_dir), model, optimizer, saved_on), train_and_save)
    expected = original[0]["losses"][SAVE_AT:]
    rng_of = {tuple(r["coords"]): r["rng"] for r in original}
    resumed = []
    for parallelism in layouts:
        results = run(job(str(ckpt_dir), model, optimizer, parallelism), resume)
        for rank, r in enumerate(results):
            torch.testing.assert_close(r["losses"], expected, rtol=1e-5, atol=0, msg=f"{parallelism} rank {rank}")
            assert r["rng"] == rng_of[tuple(r["took"])], f"{parallelism} rank {rank}"
        resumed.append(results)
    return resumed


def test_one_rank_checkpoint_resumes_on_tp2_and_on_pp2(ckpt_dir):
    """1 -> 2 ranks: TP cuts what was whole (fused q|k|v and gate|up included); the last stage's tied
    output embedding comes from the input embedding, the only copy a one-stage checkpoint holds."""
    assert_resumes_on(ckpt_dir, {**LLAMA_GQA, "tied_embeddings": True}, "adamw", {}, [{"tp": 2}, {"pp": 2}])


@pytest.mark.slow
def test_gpt_lamb_tp2_pp2_dp2_resumes_on_tp1_pp4_dp2_tp2_pp1_dp4_and_one_rank(ckpt_dir):
    resumed = assert_resumes_on(ckpt_dir, GPT_TIED, "lamb", {"tp": 2, "pp": 2, "dp": 2},
                                [{"pp": 4, "dp": 2}, {"tp": 2, "dp": 4}, {}])
    # Resharding keeps host-memory restore: a rank whose old self holds a shard it needs uses it.
    assert sum(r["from"].get("host memory", 0) for r in resumed[0]) > 0


@pytest.mark.slow
def test_llama_gqa_adamw_tp2_pp2_vpp2_dp2_sp_resumes_on_tp1_pp4_dp2_tp2_pp1_dp4_and_one_rank(ckpt_dir):
    assert_resumes_on(ckpt_dir, LLAMA_GQA, "adamw", {"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "sequence_parallel": True},
                      [{"pp": 4, "dp": 2}, {"tp": 2, "dp": 4, "sequence_parallel": True}, {}])


@pytest.mark.parametrize("change, error", [
    ({"parallelism": {"tp": 3}}, "parallelism.tp=3 does not divide model.heads=4"),
    ({"parallelism": {"tp": 4}, "model": {"kv_heads": 2}}, "parallelism.tp=4 does not divide model.kv_heads=2"),
    ({"parallelism": {"pp": 3}}, "model.layers=4 is not divisible by parallelism.pp*vpp=3"),
    ({"model": {"hidden": 64}}, "checkpoint step 4 has model.hidden=32, this job has model.hidden=64"),
    ({"model": {"arch": "llama"}}, "checkpoint step 4 has model.arch='gpt', this job has model.arch='llama'"),
    ({"model": {"kv_heads": 2}}, "checkpoint step 4 has model.kv_heads=4, this job has model.kv_heads=2"),
], ids=["tp-heads", "tp-kv-heads", "pp-layers", "hidden", "arch", "kv-heads"])
def test_a_resume_that_cannot_work_is_refused_in_one_line_before_any_rank_starts(tmp_path, capsys, change, error):
    uri = str(tmp_path / "ckpt")
    saved = job_dict(uri, {}, "lamb", {"tp": 2, "dp": 2})
    # Only the manifest is read: no rank runs, so none of a real checkpoint's shards are needed.
    (tmp_path / "ckpt" / "step-00000004").mkdir(parents=True)
    write_manifest(open_storage(uri), SAVE_AT, new_manifest(SAVE_AT, {"tp": 2, "pp": 1, "dp": 2, "vpp": 1},
                                                           from_dict(saved).to_dict(), {}))
    config = {**saved, **{section: {**saved[section], **fields} for section, fields in change.items()}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--quiet", "--resume", "--run-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert error in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("rank-*.log"))
