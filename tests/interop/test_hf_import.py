"""Hugging Face weights in: a tiny transformers model made from a config and saved with save_pretrained
gives, imported into megascale, the transformers logits within 1e-4 at 1 rank; `megascale import`
writes a step-0 checkpoint at the job's layout whose resumed first step has the transformers loss, at 1
rank and at tp2*pp2*dp2; `checkpoint.init_from: hf:DIR` starts a fresh job from the same weights.

The CLI runs in a child process: a rank forked from a process that already ran multi-threaded torch
ops (this test process) hangs in OpenMP."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from hf_support import ATOL, model_section, tiny_hf_model, tokens

from megascale.checkpoint import committed_steps, open_storage
from megascale.config import from_dict
from megascale.interop import load_hf_weights
from megascale.parallel.topology import single_device_context
from megascale.synthetic import SyntheticSource
from megascale.train import Trainer

KINDS = {  # id: (transformers model kind, its options)
    "llama": ("llama", {}),
    "mistral_window_tied": ("llama", {"window": 8, "tied": True}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_parallel_tied": ("gpt_neox", {"parallel": True, "tied": True}),
}


def job_dict(model: dict, parallelism: dict | None = None, **sections) -> dict:
    return {"model": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 96, "vocab": 128, "seq": 32, **model},
            "parallelism": parallelism or {}, "batch": {"micro": 1, "global": 4},
            "optimizer": {"name": "adamw", "lr": 0.01}, "train": {"steps": 1}, **sections}


def saved(tmp_path, kind: str, **options):
    model = tiny_hf_model(kind, **options)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


@pytest.mark.parametrize("case", list(KINDS))
def test_imported_weights_give_the_transformers_logits(case, tmp_path):
    kind, options = KINDS[case]
    theirs, directory = saved(tmp_path, kind, **options)
    cfg = from_dict(job_dict(model_section(kind, **options)))
    ctx = single_device_context()
    trainer = Trainer(cfg, ctx)
    try:
        load_hf_weights(trainer.optimizer, ctx, cfg.model, directory)
        ids = tokens(cfg)
        with torch.no_grad():
            torch.testing.assert_close(trainer.chunks[0](ids), theirs(input_ids=ids).logits, rtol=0, atol=ATOL)
    finally:
        trainer.close()


def hf_loss(model, cfg_dict: dict) -> float:
    """The transformers model's mean loss on the first synthetic batch a megascale job trains on."""
    m, b = cfg_dict["model"], cfg_dict["batch"]
    inputs, labels = SyntheticSource(vocab=m["vocab"], seq=m["seq"], global_batch=b["global"], dp_rank=0,
                                     dp_size=1, seed=0).next_batch()
    with torch.no_grad():
        return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten()).item()


def megascale(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascale.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def first_loss(run_root) -> float:
    (run_dir,) = [d for d in run_root.iterdir() if d.is_dir()]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def import_then_resume(tmp_path, directory, cfg_dict: dict) -> float:
    """`megascale import` into a fresh uri, then one resumed training step: its loss."""
    uri = str(tmp_path / "imported")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg_dict))
    done = megascale("import", "--from", "hf", str(directory), "--config", str(config), uri, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert committed_steps(open_storage(uri)) == [0]
    again = megascale("import", "--from", "hf", str(directory), "--config", str(config), uri, cwd=tmp_path)
    refused = (f"ConfigError: OUT_CHECKPOINT={uri} already holds committed checkpoints (newest step 0) of an "
               "earlier run: import into a uri that holds none")
    assert (again.returncode, again.stderr.strip()) == (2, refused)
    cfg_dict["checkpoint"] = {"uri": uri, "resume": True}
    config.write_text(yaml.safe_dump(cfg_dict))
    done = megascale("train", str(config), "--quiet", "--run-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return first_loss(tmp_path / "runs")


def test_import_writes_a_step0_checkpoint_a_job_resumes_with_the_transformers_loss(tmp_path):
    theirs, directory = saved(tmp_path, "llama")
    cfg_dict = job_dict(model_section("llama"))
    assert import_then_resume(tmp_path, directory, cfg_dict) == pytest.approx(hf_loss(theirs, cfg_dict), rel=1e-5)


def test_init_from_starts_a_fresh_job_from_the_transformers_weights(tmp_path):
    theirs, directory = saved(tmp_path, "gpt_neox", parallel=True)
    cfg_dict = job_dict(model_section("gpt_neox", parallel=True), checkpoint={"init_from": f"hf:{directory}"})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg_dict))
    done = megascale("train", str(config), "--quiet", "--run-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert first_loss(tmp_path / "runs") == pytest.approx(hf_loss(theirs, cfg_dict), rel=1e-5)


@pytest.mark.slow
def test_import_at_tp2_pp2_dp2_resumes_with_the_transformers_loss(tmp_path):
    theirs, directory = saved(tmp_path, "llama")
    cfg_dict = job_dict(model_section("llama"), {"tp": 2, "pp": 2, "dp": 2})
    assert import_then_resume(tmp_path, directory, cfg_dict) == pytest.approx(hf_loss(theirs, cfg_dict), rel=1e-5)
