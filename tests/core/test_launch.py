"""One rank start-up (`init_rank`): `megascale train` has no job-wide deadline, and `comm.timeout_s`
is the process group's timeout, the one backstop for a rank stuck in a collective."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from megascale.config import CommConfig
from megascale.launch import RANKS_SCRATCH, run_ranks
from megascale.parallel.comm import all_reduce
from megascale.parallel.topology import Layout

TIMEOUT_S = 2.0


def test_train_runs_longer_than_comm_timeout_and_completes(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "long",
        "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
        "parallelism": {"dp": 2},
        "batch": {"micro": 1, "global": 2},
        "comm": {"timeout_s": TIMEOUT_S},
        "train": {"steps": 400, "log_every": 100, "run_dir": str(tmp_path / "runs")},
    }))
    started = time.monotonic()
    # From another directory, as a user runs it: the CLI's own process, not an in-process call.
    result = subprocess.run([sys.executable, "-m", "megascale.cli", "train", str(config), "--quiet"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 400
    assert elapsed > 2 * TIMEOUT_S, f"the job took {elapsed:.1f} s: make it run longer than comm.timeout_s"


def _late_rank_joins_after(ctx, delay_s: float) -> float:
    if ctx.rank == 1:
        time.sleep(delay_s)
    started = time.monotonic()
    all_reduce(torch.ones(1), ctx.dp)
    return time.monotonic() - started


def test_comm_timeout_is_the_process_group_timeout():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed: .*[Tt]imed out"):
        run_ranks(_late_rank_joins_after, Layout(dp=2), 30.0, comm=CommConfig(timeout_s=TIMEOUT_S))
    assert time.monotonic() - started < 20  # rank 0 gave up after comm.timeout_s, not after rank 1's 30 s


def _cosine_with_threads(ctx) -> int:
    torch.rand(100_000, dtype=torch.float64).cos()  # MKL's threaded vector math: hangs in a fork-unsafe child
    return torch.get_num_threads()


def test_ranks_forked_from_a_process_that_ran_threaded_torch_do_not_hang():
    torch.set_num_threads(2)
    torch.rand(100_000, dtype=torch.float64).cos()  # the parent's OpenMP pool now exists
    assert run_ranks(_cosine_with_threads, Layout()) == [1]


def _sum_across_ranks(ctx) -> float:
    value = torch.ones(1)
    all_reduce(value, ctx.dp)
    return value.item()


def test_ranks_meet_in_their_run_directory_replacing_what_a_killed_launcher_left_there(tmp_path):
    stale = tmp_path / RANKS_SCRATCH
    stale.mkdir()
    (stale / "store").write_bytes(b"a killed launch's rendezvous file")  # would hand the new ranks old keys
    (stale / "rank0.pt").write_bytes(b"and its result")
    assert run_ranks(_sum_across_ranks, Layout(dp=2), run_dir=str(tmp_path)) == [2.0, 2.0]
    assert not stale.exists()  # removed after the ranks, as a temporary directory is
