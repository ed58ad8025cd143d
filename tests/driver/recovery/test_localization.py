"""Hang localisation: ring buffers readable while a rank hangs name the rank the others wait for."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from megascale.common.flight_format import read_records
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
