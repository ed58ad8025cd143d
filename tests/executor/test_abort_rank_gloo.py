"""What `abort_rank` can and cannot break off in gloo (torch 2.13), measured on two real gloo ranks whose peer
has stopped: why the executor stops a rank that has not left its incarnation within LEAVE_TIMEOUT_S.

A collective waiting to *receive* fails as soon as the rank's connections are shut down. A send whose bytes are
already going out (the peer had posted its receive, the socket's buffers are full) does not: gloo's
`Pair::signalException` wakes bound buffers and pending sends and receives, but not an unbound buffer whose send
sits in the pair's write queue (`tx_`), so the send waits out the group's timeout. This is the rank stuck in a
TP all-gather or reduce-scatter that soaks found (3 of 24, 4 of 164 leaves); if a torch upgrade fixes gloo, the
second test fails and the executor's limit can go."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megascale.common.processes import free_port

PEER = Path(__file__).with_name("gloo_abort_peer.py")


def _aborted(mode: str) -> str:
    """Rank 0's line: how long its `mode` operation took to fail after the abort."""
    port = free_port()
    stopped = subprocess.Popen([sys.executable, str(PEER), "1", str(port), mode], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run([sys.executable, str(PEER), "0", str(port), mode], capture_output=True, text=True,
                             timeout=60)
        return out.stdout.strip()
    finally:
        stopped.kill()
        stopped.wait()


def test_a_rank_waiting_to_receive_from_a_stopped_peer_fails_at_the_abort():
    line = _aborted("recv")
    assert line.startswith("failed after ")
    assert float(line.split()[-1]) < 1.0 + 2.0  # the abort comes at 1 s; the group's timeout is 5 s


def test_a_send_already_on_the_wire_to_a_stopped_peer_waits_out_the_groups_timeout():
    line = _aborted("send")
    assert line.startswith("failed after ")
    assert float(line.split()[-1]) == pytest.approx(5.0, abs=1.5)  # not woken by the abort at 1 s
