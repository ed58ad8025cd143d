"""Fixtures of the driver's tests: real Redis, real broker and leak-checked processes (tests/service_fixtures.py),
and, for the metrics and dashboard tests, one real 4-rank training run (tp2 x dp2, gloo, CPU) with rank 3 made slow
from a known step by a sleep inside its forward pass, plus headless Chromium.

Test hosts are shared and oversubscribed: a rank's ~12 ms of compute a step varies by half from one
step to the next, and the warm-up steps by much more. The detector measures that noise itself, so the
tests judge real timings with production's thresholds, against a slowdown several times that noise.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from service_fixtures import *  # noqa: F401,F403 - pytest collects the fixtures by name

sys.path.insert(0, str(Path(__file__).parent))  # control_plane_support, under --import-mode=importlib

from megascale.config import from_dict
from megascale.launch import run_ranks
from megascale.driver.metrics.stragglers import Thresholds
from megascale.parallel.topology import Layout

SLOW_RANK = 3
RANKS_PER_NODE = 2  # two "nodes" of two ranks: the slow rank lives on node 1
ONSET = 8  # the first slow step (Trainer numbers steps from 1)
STEPS = 14
DELAY_S = 0.05  # per forward call; two microbatches per step: +100 ms on ~20 ms of compute a step
MICROBATCHES = 2
THRESHOLDS = Thresholds()  # production's


def _train_with_a_slow_rank(ctx, cfg, slow_rank: int, delay_s: float, onset: int) -> list[dict]:
    import time

    from megascale.train import Trainer

    trainer = Trainer(cfg, ctx)
    if ctx.rank == slow_rank:
        for chunk in trainer.chunks:
            forward = chunk.forward

            def slow_forward(*args, _forward=forward, **kwargs):
                if trainer.step_index + 1 >= onset:  # step_index is the number of steps done
                    time.sleep(delay_s)
                return _forward(*args, **kwargs)

            chunk.forward = slow_forward
    try:
        timings = [trainer.step().timings for _ in range(cfg.train.steps)]
        trainer.finish()
        return timings
    finally:
        trainer.close()


@pytest.fixture(scope="session")
def real_run() -> list[dict]:
    """StepTimings dicts of every rank and step of one real run."""
    cfg = from_dict({"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                     "batch": {"micro": 2, "global": 2 * 2 * MICROBATCHES},
                     "parallelism": {"tp": 2, "dp": 2, "pp": 1, "backend": "gloo"},
                     "train": {"steps": STEPS, "gc_every": 0}})
    per_rank = run_ranks(_train_with_a_slow_rank, Layout(tp=2, dp=2, pp=1), cfg, SLOW_RANK, DELAY_S, ONSET,
                         backend="gloo")
    return [rec for records in per_rank for rec in records]


def write_run_dir(folder: Path, records: list[dict], name: str = "demo", ranks_per_node: int = RANKS_PER_NODE) -> Path:
    """A run directory as `megascale train` leaves it: config, reporting metrics, per-rank timings."""
    folder.mkdir(parents=True, exist_ok=True)
    steps = max(r["step"] for r in records)
    (folder / "config.yaml").write_text(f"name: {name}\nparallelism: {{tp: 2, dp: 2, pp: 1}}\n"
                                        f"cluster: {{ranks_per_node: {ranks_per_node}}}\ntrain: {{steps: {steps}}}\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"step": steps, "loss": 3.5, "tokens_per_s": 1000.0}) + "\n")
    for rank in sorted({r["rank"] for r in records}):
        lines = [json.dumps(r) for r in records if r["rank"] == rank]
        (folder / f"timings-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="session")
def facts() -> SimpleNamespace:
    """The constants of `real_run` (tests are not a package here, so they cannot import this module)."""
    return SimpleNamespace(SLOW_RANK=SLOW_RANK, RANKS_PER_NODE=RANKS_PER_NODE, ONSET=ONSET, STEPS=STEPS,
                           DELAY_S=DELAY_S, MICROBATCHES=MICROBATCHES, THRESHOLDS=THRESHOLDS,
                           write_run_dir=write_run_dir)


@pytest.fixture
def kafka(broker) -> str:
    """The shared memory-only tansu broker's bootstrap address."""
    return broker.bootstrap


@pytest.fixture(scope="session")
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            try:
                subprocess.run([path, "--version"], capture_output=True, timeout=20, check=True)
                return path
            except (OSError, subprocess.SubprocessError):
                continue
    pytest.skip("no headless Chromium on this host (Debian: apt-get install -y chromium)")
