"""Hang localisation: ring buffers readable while a rank hangs name the rank the others wait for."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from megascale.executor.host import halted_state
from megascale.common.flight_format import NO_PEER, OpRecord, read_records
from megascale.driver.recovery import localize_hang
from megascale.driver.recovery.localization import group_members
from megascale.launch import run_ranks
from megascale.parallel.comm import all_reduce
from megascale.parallel.flight_recorder import FlightRecorder
from megascale.parallel.topology import Layout

LAYOUT = Layout(tp=2, dp=2)
HUNG = 3


def _collectives_then_one_rank_hangs(ctx, folder: str) -> None:
    ctx.attach_recorder(FlightRecorder(Path(folder) / f"flight-rank{ctx.rank}.bin"))
    x = torch.ones(4)
    for _ in range(3):
        all_reduce(all_reduce(x, ctx.tp), ctx.dp)
    if ctx.rank == HUNG:
        time.sleep(4)  # stands in for a stopped process or a stuck kernel
    all_reduce(all_reduce(x, ctx.tp), ctx.dp)


def test_hung_rank_is_named_while_its_peers_wait(tmp_path):
    job = threading.Thread(target=run_ranks, args=(_collectives_then_one_rank_hangs, LAYOUT, str(tmp_path)))
    job.start()
    time.sleep(2.5)  # every other rank is now blocked in a collective
    records = {r: read_records(tmp_path / f"flight-rank{r}.bin") for r in range(LAYOUT.world_size)}
    report = localize_hang(records, group_members(LAYOUT.tp, LAYOUT.pp, LAYOUT.dp))
    job.join()
    assert report.suspects == [HUNG], report
    assert HUNG not in report.waiting and len(report.waiting) == 3
    assert "all_reduce #4 on tp:2" in report.waiting[2]


def test_no_hang_when_nothing_is_in_flight(tmp_path):
    recorder = FlightRecorder(tmp_path / "f.bin")
    recorder.end(recorder.begin("all_reduce", "tp:0", 2))
    assert localize_hang({0: read_records(tmp_path / "f.bin")}, {"tp:0": [0, 1]}).suspects == []


def test_a_rank_stopped_inside_the_collective_is_named_by_its_process_state():
    """SIGSTOP can land after a rank entered the collective: every record then says "entered", and only
    the OS's word that the process is stopped names it."""
    def in_flight(seq: int) -> list[OpRecord]:
        return [OpRecord(seq, "all_reduce", "tp:2", 2, NO_PEER, 1.0, None)]

    records = {0: [], 1: [], 2: in_flight(4), 3: in_flight(4)}
    groups = group_members(LAYOUT.tp, LAYOUT.pp, LAYOUT.dp)
    assert localize_hang(records, groups).suspects == []
    report = localize_hang(records, groups, halted={3: "stopped"})
    assert report.suspects == [HUNG] and list(report.waiting) == [2], report
    assert "(the OS shows rank 3: stopped)" in report.reason


def test_a_peer_stuck_beside_the_stopped_rank_is_not_blamed_for_the_ranks_waiting_on_it():
    """Seen in a CI run: rank 3 stopped inside dp:1's all-gather, which rank 1 had entered as well; ranks 0
    and 2 wait in a TP reduce-scatter that ranks 1 and 3 never reached. Records alone name both 1 and 3."""
    tp = lambda rank: [OpRecord(518, "reduce_scatter", f"tp:{rank - rank % 2}", 2, NO_PEER, 1.0, None)]  # noqa: E731
    dp = [OpRecord(77, "all_gather", "dp:1", 2, NO_PEER, 1.0, None)]
    records = {0: tp(0), 2: tp(2), 1: dp, 3: dp}
    groups = {"tp:0": [0, 1], "tp:2": [2, 3], "dp:1": [1, 3]}
    assert localize_hang(records, groups).suspects == [1, 3]
    assert localize_hang(records, groups, halted={3: "stopped"}).suspects == [3]


def test_halted_state_reads_a_stopped_a_zombie_and_a_gone_process():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert halted_state(child.pid) == ""
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while halted_state(child.pid) != "stopped" and time.time() < deadline:
            time.sleep(0.05)
        assert halted_state(child.pid) == "stopped"
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        deadline = time.time() + 5
        while halted_state(child.pid) != "zombie" and time.time() < deadline:  # exited, not yet reaped
            time.sleep(0.05)
        assert halted_state(child.pid) == "zombie"
    finally:
        child.kill()
        child.wait()
    assert halted_state(child.pid) == "dead"
