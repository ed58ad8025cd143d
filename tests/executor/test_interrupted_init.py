"""A rank whose process-group init was cut short (in-process restart: the order to leave came during the
rendezvous) meets fresh processes in the next incarnation. Before the fix, torch's group counter stayed
advanced and that incarnation's rendezvous hung (found by pausing a job and killing a node just after resume)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megascale.config import CommConfig
from megascale.parallel.topology import Layout
from megascale.rank import init_rank, shutdown_rank

PEER = """
import sys, torch, torch.distributed as dist
from megascale.config import CommConfig
from megascale.parallel.topology import Layout
from megascale.rank import init_rank, shutdown_rank
ctx = init_rank(Layout(dp=2), 1, sys.argv[1], CommConfig(timeout_s=30), backend="gloo", threads=1)
x = torch.ones(1)
dist.all_reduce(x)
shutdown_rank(ctx)
print(float(x))
"""


class CutShort(BaseException):
    """What executor/rank.py's Leave is: raised in the main thread by a signal."""


def _cut_short(signum, frame):
    raise CutShort()


def test_a_rank_whose_init_was_cut_short_meets_new_processes_in_the_next_incarnation(redis_server):
    url = f"{redis_server.url}/interrupted"
    previous = signal.signal(signal.SIGALRM, _cut_short)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # rank 1 never comes: rank 0 waits in the rendezvous
        with pytest.raises(CutShort):
            init_rank(Layout(dp=2), 0, f"{url}?incarnation=1", CommConfig(timeout_s=30), backend="gloo", threads=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    shutdown_rank(None)
    assert not dist.is_initialized()

    peer = subprocess.Popen([sys.executable, "-c", PEER, f"{url}?incarnation=2"], stdout=subprocess.PIPE, text=True)
    try:
        ctx = init_rank(Layout(dp=2), 0, f"{url}?incarnation=2", CommConfig(timeout_s=30), backend="gloo",
                        threads=1)
        x = torch.ones(1)
        dist.all_reduce(x)
        shutdown_rank(ctx)
        assert float(x) == 2.0 and peer.communicate(timeout=60)[0].strip() == "2.0"
    finally:
        peer.kill()
        peer.wait()
