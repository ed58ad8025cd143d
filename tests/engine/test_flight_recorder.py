"""Hang localisation: ring buffers readable while a rank hangs name the rank the others wait for."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from megascale.launch import run_ranks
from megascale.parallel.comm import all_reduce
from megascale.common.flight_format import read_records
from megascale.parallel.flight_recorder import FlightRecorder, localize_hang
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
    members = {f"tp:{LAYOUT.tp_members(r)[0]}": LAYOUT.tp_members(r) for r in range(4)}
    members |= {f"dp:{LAYOUT.dp_members(r)[0]}": LAYOUT.dp_members(r) for r in range(4)}
    report = localize_hang(records, members)
    job.join()
    assert report.suspects == [HUNG], report
    assert HUNG not in report.waiting and len(report.waiting) == 3
    assert "all_reduce #4 on tp:2" in report.waiting[2]


def test_ring_buffer_keeps_the_newest_records_in_order(tmp_path):
    recorder = FlightRecorder(tmp_path / "f.bin", capacity=4)
    for _ in range(6):
        recorder.end(recorder.begin("all_reduce", "dp:0", 2))
    slot = recorder.begin("send", "pp_forward:0", 2, peer=1)
    records = read_records(tmp_path / "f.bin")
    assert [r.seq for r in records] == [4, 5, 6, 1]
    assert records[-1].ended is None and records[-1].peer == 1 and records[0].ended is not None
    recorder.end(slot)
    assert read_records(tmp_path / "f.bin")[-1].ended is not None


def test_no_hang_when_nothing_is_in_flight(tmp_path):
    recorder = FlightRecorder(tmp_path / "f.bin")
    recorder.end(recorder.begin("all_reduce", "tp:0", 2))
    assert localize_hang({0: read_records(tmp_path / "f.bin")}, {"tp:0": [0, 1]}).suspects == []
