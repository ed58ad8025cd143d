"""The flight recorder's ring buffer, readable while its rank runs (tests/driver/test_recovery_localization.py:
what the driver reads in it)."""
from __future__ import annotations

from megascale.common.flight_format import read_records
from megascale.parallel.flight_recorder import FlightRecorder


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
