"""Per-step JSON-lines files rolled over at a size (megascale/common/jsonl.py): bounded on disk, and read by their
tailers line by line across every rollover, nothing lost, nothing twice."""
from __future__ import annotations

import json
import os
import random

from megascale.common.jsonl import LineFollower, RollingWriter, rolled


def _steps(lines: list[bytes]) -> list[int]:
    return [json.loads(line)["step"] for line in lines]


def test_the_writer_keeps_the_file_and_one_earlier_part_under_the_limit(tmp_path):
    path = tmp_path / "timings-rank0.jsonl"
    writer = RollingWriter(path, max_bytes=1000)
    for step in range(500):
        writer.write(json.dumps({"step": step, "pad": "x" * 30}))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timings-rank0.1.jsonl", "timings-rank0.jsonl"]
    assert path.stat().st_size < 1000 and 1000 <= rolled(path).stat().st_size < 1100
    kept = _steps(rolled(path).read_bytes().splitlines() + path.read_bytes().splitlines())
    assert kept == list(range(kept[0], 500)) and kept[0] > 400  # the newest lines, in order


def test_the_follower_reads_every_line_once_across_rollovers_wherever_its_reads_fall(tmp_path):
    path = tmp_path / "rank3.progress.jsonl"
    writer, follower, rng = RollingWriter(path, max_bytes=600), LineFollower(), random.Random(0)
    seen = []
    for step in range(2000):
        writer.write(json.dumps({"step": step}))
        if rng.random() < 0.2:  # a read every ~5 lines, falling anywhere against the rollovers (every ~40 lines)
            seen += _steps(follower.read(path))
    writer.close()
    seen += _steps(follower.read(path))
    assert seen == list(range(2000))


def test_a_read_between_the_rename_and_the_new_file_loses_nothing(tmp_path):
    path = tmp_path / "timings-rank1.jsonl"
    follower = LineFollower()
    path.write_text('{"step": 1}\n')
    assert _steps(follower.read(path)) == [1]
    with open(path, "a") as f:
        f.write('{"step": 2}\n{"step": 3')  # a half-written line waits
    assert _steps(follower.read(path)) == [2]
    with open(path, "a") as f:
        f.write('}\n')
    os.replace(path, rolled(path))  # the writer rolled over and has not opened the new file yet
    assert _steps(follower.read(path)) == [3]
    path.write_text('{"step": 4}\n')
    assert _steps(follower.read(path)) == [4]


def test_a_first_read_takes_the_history_on_disk_and_skip_to_end_only_what_comes_after(tmp_path):
    path = tmp_path / "timings-rank2.jsonl"
    writer = RollingWriter(path, max_bytes=150)  # 12 bytes a line
    for step in range(20):
        writer.write(json.dumps({"step": step}))
    on_disk = _steps(rolled(path).read_bytes().splitlines() + path.read_bytes().splitlines())
    assert _steps(LineFollower().read(path)) == on_disk
    late = LineFollower()
    late.skip_to_end(path)
    assert late.read(path) == []
    for step in range(20, 30):  # one rollover at most
        writer.write(json.dumps({"step": step}))
    assert _steps(late.read(path)) == list(range(20, 30))
    missing = LineFollower()
    missing.skip_to_end(tmp_path / "none.jsonl")  # not written yet: all of it is new
    (tmp_path / "none.jsonl").write_text('{"step": 7}\n')
    assert _steps(missing.read(tmp_path / "none.jsonl")) == [7]


def test_a_first_read_during_a_rollover_takes_the_part_once(tmp_path):
    path = tmp_path / "timings-rank3.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    os.link(path, rolled(path))  # as if the file opened for reading had just been renamed to its earlier part
    assert _steps(LineFollower().read(path)) == [1, 2]


def test_the_timings_tail_skips_lines_that_are_no_timings_record_whatever_json_they_hold(tmp_path):
    from megascale.common.messages import JsonlTail

    record = {"step": 7, "rank": 0, "tp": 0, "pp": 0, "dp": 0, "start": 1.0, "total": 0.5, "segments": {}}
    path = tmp_path / "timings-rank0.jsonl"
    # a number, a list, a string, null, half a line of JSON, an object that is no record: a stray `5` crashed it
    path.write_text("5\n[]\n\"x\"\nnull\n{\"step\": \n{\"step\": 1}\n" + json.dumps(record) + "\n"
                    + json.dumps({"step": 7, "loss": 1.0, "timings": record}) + "\n")
    assert JsonlTail().read([path]) == [record, record]
