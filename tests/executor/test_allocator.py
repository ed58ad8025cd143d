"""Rank processes run on jemalloc where the node has it (executor/allocator.py): read from the processes' own
memory maps, not from the environment the executor meant to give them."""
from __future__ import annotations

import ctypes.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.executor import allocator
from megascale.executor.standby import Standbys

needs_jemalloc = pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None,
                                    reason="jemalloc is not installed here (Debian: libjemalloc2)")


def mapped_libraries(pid: int) -> str:
    """The process's maps once its interpreter has loaded an extension module: preloads are mapped before."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        maps = Path(f"/proc/{pid}/maps").read_text()
        if "lib-dynload" in maps:
            return maps
        time.sleep(0.05)
    raise AssertionError("the standby process loaded no extension module within 30 s")


def standby_process(tmp_path: Path) -> subprocess.Popen:
    allocator.rank_allocator_env.cache_clear()
    pool = Standbys(tmp_path, training=1, idle=1, settle_s=0.0)
    pool.refill(training=False)  # steady from now
    pool.refill(training=False)
    assert len(pool.procs) == 1
    return pool.procs.pop()


@needs_jemalloc
@pytest.mark.parametrize("choice, on_jemalloc", [(None, True), ("jemalloc", True), ("system", False)])
def test_a_standby_rank_process_runs_on_the_chosen_allocator(tmp_path, monkeypatch, choice, on_jemalloc):
    if choice is None:
        monkeypatch.delenv(allocator.MALLOC_ENV, raising=False)
    else:
        monkeypatch.setenv(allocator.MALLOC_ENV, choice)
    proc = standby_process(tmp_path)
    try:
        assert ("libjemalloc" in mapped_libraries(proc.pid)) == on_jemalloc
    finally:
        proc.kill()
        proc.wait()
        allocator.rank_allocator_env.cache_clear()


def test_an_unknown_allocator_stops_the_executor_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(allocator.MALLOC_ENV, "tcmalloc")
    done = subprocess.run([sys.executable, "-m", "megascale.executor", "--job", "j", "--node", "n0", "--redis",
                           "redis://127.0.0.1:1", "--kafka", "127.0.0.1:1", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("MEGASCALE_RANK_MALLOC='tcmalloc': must be one of jemalloc, system")
