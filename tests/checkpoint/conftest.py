"""Small jobs, the instrumented file system, and keepers shut down after every test."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from megascale.checkpoint import shutdown_keeper
from megascale.checkpoint.client import _log_path
from megascale.config import JobConfig, from_dict


def _load_fsutil():
    spec = importlib.util.spec_from_file_location("megascale_test_fsutil", Path(__file__).with_name("fsutil.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fsutil = _load_fsutil()


def job(uri: str, parallelism: dict | None = None, steps: int = 4, **checkpoint) -> JobConfig:
    return from_dict({
        "model": {"layers": 4, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16, "block": "parallel"},
        "parallelism": parallelism or {},
        "batch": {"micro": 1, "global": 4},
        # Warm-up then cosine: a resumed run only matches if it resumes the schedule too.
        "optimizer": {"name": "lamb", "lr": 0.02, "schedule": {"kind": "cosine", "warmup_steps": 1}},
        # In-memory snapshots only where a test asks: the others test the persisted path.
        "checkpoint": {"uri": uri, "filesystem": fsutil.SPEC, "keeper_idle_s": 120, "memory_every": 0, **checkpoint},
        "train": {"steps": steps},
    })


@pytest.fixture(scope="session", autouse=True)
def instrumented_plugin(tmp_path_factory):
    """The instrumented file system, installed as a plugin here, in the keepers and in `megascale train`."""
    directory = fsutil.register(tmp_path_factory.mktemp("plugins"))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(directory))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")])))
        yield


@pytest.fixture
def ckpt_dir(tmp_path):
    root = tmp_path / "ckpt"
    yield root
    shutdown_keeper(str(root))
    _log_path(str(root)).unlink(missing_ok=True)  # kept by keepers that logged errors on purpose


@pytest.fixture
def fs():
    """The instrumented file system module (reads, set_options, SPEC)."""
    return fsutil


@pytest.fixture
def make_job():
    return job
