"""A rank that does not leave its incarnation when ordered (blocked where no abort reaches): before the
executor stops it, its threads' stacks reach its log, so that the log says where it was stuck."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from megascale.common.rankspec import RankSpec
from megascale.executor.ranks import RANK_ENTRY_ENV, RankGroup, RankProcess

STUCK_RANK = """
import threading
from megascale.executor.rank import answer_stack_requests

answer_stack_requests()
print("in", flush=True)

def blocked_in_c():  # a lock held by no one who will let go: neither an order nor a Python handler gets it out
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()

blocked_in_c()
"""


def test_a_rank_that_does_not_leave_logs_its_stacks_and_is_stopped(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.delenv(RANK_ENTRY_ENV, raising=False)  # in-process restarts: the executor orders ranks out
    log_path = tmp_path / "rank0.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", STUCK_RANK], stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT)
    os.set_blocking(proc.stdin.fileno(), False)
    try:
        deadline = time.monotonic() + 30
        while "in" not in log_path.read_text():  # its handler is registered
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        spec = RankSpec(job="j", node="n0", incarnation=2, world_size=1, config={}, run_dir=str(tmp_path),
                        init_method="redis://127.0.0.1:1/j?incarnation=2")
        kept = RankProcess(0, 0, proc, log_path, tmp_path / "progress.jsonl")
        group = RankGroup(tmp_path, spec, [0], {}, kept={0: kept})
        with caplog.at_level(logging.WARNING, logger="megascale.executor"):
            assert group.leave(timeout_s=0.5, grace_s=2.0) == 0
        assert proc.poll() is not None  # stopped
        assert f"rank 0 (pid {proc.pid}) did not leave within 0.5 s of the order" in caplog.text
        text = log_path.read_text()
        assert "most recent call first" in text and "in blocked_in_c" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
