"""`megascale train` checkpoints every N steps and `--resume` continues exactly."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from megascale.checkpoint import committed_steps, open_storage, shutdown_keeper
from megascale.cli import main
from megascale.config import ConfigError, load_config
from megascale.launch import RANKS_SCRATCH


def metrics(run_root) -> list[dict]:
    (run_dir,) = [d for d in run_root.iterdir() if d.is_dir()]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_saves_every_n_steps_and_resume_continues_exactly(tmp_path):
    uri = f"file://{tmp_path / 'ckpt'}"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "ckpt-cli",
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "batch": {"micro": 1, "global": 2},
        "optimizer": {"lr": 0.02, "schedule": {"warmup_steps": 1}},
        # No in-memory snapshots: in this one process the first run's keeper outlives it, and would hand
        # the second its step-6 snapshot (a separate `megascale train` process takes its keeper with it).
        "checkpoint": {"uri": uri, "every": 4, "keeper_idle_s": 60, "memory_every": 0},
        "train": {"steps": 6},
    }))
    try:
        assert main(["train", str(config), "--quiet", "--run-dir", str(tmp_path / "first")]) == 0
        assert committed_steps(open_storage(uri)) == [4]  # step 6 is not a multiple of every=4
        assert main(["train", str(config), "--quiet", "--resume", "--run-dir", str(tmp_path / "second")]) == 0
    finally:
        shutdown_keeper(uri)
    first, second = metrics(tmp_path / "first"), metrics(tmp_path / "second")
    assert [m["step"] for m in second] == [5, 6]
    assert [m["loss"] for m in second] == [m["loss"] for m in first[4:]]


def test_a_run_directory_goes_on_with_resume_in_place_on_another_layout(tmp_path, capfd):
    """With "{run_dir}/checkpoints" every run has its own: `megascale train RUN_DIR --resume` continues that
    run there (its checkpoints, metrics.jsonl, config.yaml, with --set applied); resuming a new run of the
    job YAML, which can find nothing, is refused in one line naming the command."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "per-run",
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "batch": {"micro": 1, "global": 2}, "optimizer": {"lr": 0.02},
        "checkpoint": {"uri": "{run_dir}/checkpoints", "every": 2, "memory_every": 0},
        "train": {"steps": 4, "run_dir": str(tmp_path / "runs")}}))
    assert main(["train", str(config), "--quiet", "--steps", "2"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    capfd.readouterr()
    for argv, said in ((["train", str(config), "--resume"], "continue a run with `megascale train RUN_DIR --resume`"),
                       (["train", str(run_dir / "config.yaml"), "--resume"], f"`megascale train {run_dir} --resume`"),
                       (["train", str(run_dir)], "continue that run with --resume"),
                       (["train", str(tmp_path / "runs"), "--resume"], "not a run directory (no config.yaml)")):
        assert main(argv + ["--quiet"]) == 2
        err = capfd.readouterr().err.strip()
        assert said in err and "\n" not in err and "Traceback" not in err
    assert main(["train", str(run_dir), "--resume", "--quiet", "--steps", "4", "--set", "parallelism.dp=2"]) == 0
    assert [m["step"] for m in metrics(tmp_path / "runs")] == [1, 2, 3, 4]  # 3 and 4 appended: resumed at 2
    assert committed_steps(open_storage(str(run_dir / "checkpoints"))) == [2, 4]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["parallelism"]["dp"], saved["checkpoint"]["uri"]) == (2, "{run_dir}/checkpoints")
    capfd.readouterr()
    assert main(["train", str(run_dir), "--resume", "--quiet"]) == 0  # train.steps=4 is saved, and reached
    assert "nothing to train: resumed at step 4, train.steps=4 (more with --steps N)" in capfd.readouterr().err
    moved = run_dir.rename(tmp_path / "moved")  # a run continued in place still restores its own once moved
    assert main(["train", str(moved), "--resume", "--quiet", "--steps", "6"]) == 0
    assert committed_steps(open_storage(str(moved / "checkpoints"))) == [2, 4, 6]


def test_a_config_that_is_no_yaml_file_is_one_line(tmp_path, capsys):
    (tmp_path / "binary").write_bytes(bytes(range(256)))
    assert main(["train", str(tmp_path / "binary"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"ConfigError: {tmp_path / 'binary'}: not a text file"
    with pytest.raises(ConfigError, match=f"^{tmp_path}: a directory, not a config file$"):
        load_config(tmp_path)  # as `megascale run DIR` reads it


def two_step_job(tmp_path):
    """A 2-step job checkpointing every 2 steps to tmp_path/ckpt."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "batch": {"micro": 1, "global": 2}, "checkpoint": {"uri": str(tmp_path / "ckpt"), "every": 2},
        "train": {"steps": 2, "run_dir": str(tmp_path / "runs")}}))
    return config


def test_a_fresh_job_refuses_a_uri_holding_another_runs_checkpoints(tmp_path, capsys):
    """Its restarts would restore the other run's newest checkpoint: one line naming the fix."""
    config = two_step_job(tmp_path)
    assert main(["train", str(config), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds committed checkpoints (newest step 2) of an earlier run: set checkpoint.resume: true" in err
    assert "\n" not in err and "Traceback" not in err
    assert main(["train", str(config), "--quiet", "--resume"]) == 0  # continuing is what resume is for
    per_run = {"uri": "{run_dir}/checkpoints", "every": 2}
    assert main(["train", str(config), "--quiet", "--set", f"checkpoint.uri={per_run['uri']}"]) == 0
    assert main(["train", str(config), "--quiet", "--set", f"checkpoint.uri={per_run['uri']}"]) == 0
    assert len(list((tmp_path / "runs").glob("*/checkpoints/step-00000002/manifest.json"))) == 2


def test_resuming_a_checkpoint_of_another_format_is_refused_in_one_line(tmp_path, capsys):
    config = two_step_job(tmp_path)
    try:
        assert main(["train", str(config), "--quiet"]) == 0
    finally:
        shutdown_keeper(str(tmp_path / "ckpt"))
    manifest = tmp_path / "ckpt" / "step-00000002" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 1}))  # as an earlier version wrote
    capsys.readouterr()
    assert main(["train", str(config), "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "step-00000002/manifest.json: a checkpoint in format version 1, written by another megascale" in err
    assert "\n" not in err and "Traceback" not in err


def test_killing_train_takes_its_ranks_and_keeper_with_it_and_leaves_nothing_in_tmp(tmp_path):
    """SIGKILL (or a scheduler's SIGTERM) of `megascale train` runs no cleanup: before, its ranks went on
    training as orphans and the keeper held their snapshots until keeper_idle_s, and their rendezvous
    folder stayed in /tmp (one per kill). Now that folder is in the run directory."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2},
        "checkpoint": {"uri": str(tmp_path / "ckpt"), "every": 2}, "train": {"steps": 100000}}))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    train = subprocess.Popen([sys.executable, "-m", "megascale.cli", "train", str(config), "--quiet",
                              "--run-dir", str(tmp_path / "runs")], start_new_session=True,
                             env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 120
        while not committed_steps(open_storage(str(tmp_path / "ckpt"))):
            assert train.poll() is None and time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.2)
        family = psutil.Process(train.pid).children(recursive=True)
        assert len(family) >= 3, family  # two ranks and the keeper one of them started
        os.kill(train.pid, signal.SIGKILL)
        train.wait(timeout=10)
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, [p.cmdline()[:4] for p in alive]
        assert not list(tmp.glob("megascale-ranks-*"))
        (scratch,) = (tmp_path / "runs").glob(f"*/{RANKS_SCRATCH}")  # replaced by a launch in that run directory
    finally:
        if train.poll() is None:
            train.kill()
        for proc in locals().get("family", []):  # psutil checks it is still the same process
            with contextlib.suppress(psutil.Error):
                proc.kill()
