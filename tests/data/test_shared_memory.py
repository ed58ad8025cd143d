"""kill -9 of the loader or of a rank, with real processes: survivors fail fast, nothing is left behind."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("rank_worker.py")
REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie holds no memory and no descriptors


def read_ready(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "rank did not start"
    line = proc.stdout.readline()
    assert line.startswith("READY"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return int(line.split()[1])


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("victim", ["loader", "leader", "follower"])
def test_kill_9_leaves_nothing(dataset, tmp_path, victim):
    before = shm_entries()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(dataset), str(tmp_path), str(r)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        loader = read_ready(ranks[0])
        assert read_ready(ranks[1]) == loader
        # The batches live in a memfd that both ranks map; nothing of ours is in /dev/shm.
        for r in ranks:
            assert "memfd:megascale-data" in Path(f"/proc/{r.pid}/maps").read_text()
        assert not any("megascale" in name for name in shm_entries())

        pid = {"loader": loader, "leader": ranks[0].pid, "follower": ranks[1].pid}[victim]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        survivors = [r for r in ranks if r.pid != pid]
        for r in survivors:
            assert r.wait(timeout=20) == 3  # a DataError, not a hang
        expected = {"loader": "data loader (pid", "leader": "rank 0 disconnected", "follower": "rank 1 disconnected"}
        for r in survivors:
            assert expected[victim] in r.stderr.read()
        deadline = time.monotonic() + 10
        while alive(loader) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(loader), "the loader outlived its node"
        assert time.monotonic() - t0 < 10
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
            r.wait()
            r.stdout.close()
            r.stderr.close()
    assert shm_entries() <= before  # no /dev/shm leftovers
