"""Validation in the training loop and the standard experiment logs: metrics.jsonl, TensorBoard event files
(read back with TensorBoard's own reader) and Weights & Biases offline."""
from __future__ import annotations

import importlib.machinery
import json
import math
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megascale.config import ConfigError, from_dict
from megascale.parallel.topology import single_device_context
from megascale.train import train_rank

TINY = {"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "batch": {"micro": 2, "global": 4}, "train": {"steps": 3}}


def tiny(**sections) -> dict:
    return from_dict({**TINY, **sections})


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_validation_and_step_statistics_reach_metrics_jsonl_and_tensorboard(tmp_path):
    cfg = tiny(eval={"every": 2, "steps": 2}, logging={"peak_tflops": 0.001})
    train_rank(single_device_context(), cfg, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validated = {r["step"]: r for r in records if "val_loss" in r}
    assert sorted(validated) == [2, 3]  # every 2 steps, and after the last one
    for r in validated.values():
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert 0 < r["val_loss"] < 2 * math.log(64)

    job = _scalars(tmp_path / "tensorboard" / "job")
    assert set(job) == {"loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s", "mfu"}
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert job[tag] == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in records]
    assert job["val_loss"] == [(s, pytest.approx(r["val_loss"], rel=1e-6)) for s, r in validated.items()]
    assert records[0]["mfu"] == pytest.approx(records[0]["tokens_per_s"] * _flops_per_token(cfg) / 1e9)
    rank = _scalars(tmp_path / "tensorboard" / "rank-0")
    assert rank == {"step_time": [(r["step"], pytest.approx(r["step_time"], rel=1e-6)) for r in records]}


def _flops_per_token(cfg) -> int:
    from megascale.experiment_log import model_flops_per_token

    return model_flops_per_token(cfg)


def test_wandb_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whether or not it is installed
    with pytest.raises(ConfigError, match=r"^logging.wandb: true needs the wandb package \(pip install wandb\)"):
        train_rank(single_device_context(), tiny(logging={"wandb": True}), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before training started


def test_wandb_logs_the_job_scalars_offline(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda scalars, step: calls.append((step, scalars)),
                                finish=lambda: calls.append("finish"))
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **options: calls.append(options) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train_rank(single_device_context(), tiny(logging={"wandb": True, "tensorboard": False}), str(tmp_path))
    init, *logged, finish = calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert [step for step, _ in logged] == [1, 2, 3]
    assert set(logged[0][1]) == {"loss", "lr", "grad_norm", "tokens_per_s"}  # no MFU on a CPU without a peak
    assert finish == "finish"
    assert not (tmp_path / "tensorboard").exists()
