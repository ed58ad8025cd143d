"""A rank's progress lines: the newest validation stays in the heartbeat's step statistics until the next; a NaN
step is reported though a finite one followed; the incarnation's first step is news (a heartbeat at once)."""
from __future__ import annotations

import json

from megascale.executor.ranks import RankGroup, RankProcess


def reader() -> RankGroup:
    group = RankGroup.__new__(RankGroup)  # the progress reader alone: no rank processes
    group.steps, group.nonfinite, group.first_step_news, group._stepped = [], None, False, False
    return group


def test_the_newest_validation_is_carried_to_later_steps_and_published_once(tmp_path):
    progress = tmp_path / "rank0.progress.jsonl"
    validation = {"val_loss": 2.5, "val_ppl": 12.2}
    lines = [{"step": s, "loss": 3.0 - s / 10, "time": float(s), **(validation if s == 2 else {})} for s in (1, 2, 3)]
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
    group = reader()
    group.procs = [RankProcess(0, 0, None, tmp_path / "rank0.log", progress)]
    group._read_progress(group.procs[0])
    newest = group.newest()
    assert (newest["step"], newest["val_step"], newest["val_loss"], newest["val_ppl"]) == (3, 2, 2.5, 12.2)
    assert [s.get("val_loss") for s in group.steps] == [None, 2.5, None]  # a Metric per step: val on its own step


def test_a_nan_step_between_two_heartbeats_is_reported_once_though_a_finite_step_followed(tmp_path):
    progress = tmp_path / "rank4.progress.jsonl"
    progress.write_text('{"step": 42, "loss": NaN, "time": 1.0}\n{"step": 43, "loss": 2.9, "time": 2.0}\n')
    group = reader()
    group.procs = [RankProcess(4, 0, None, tmp_path / "rank4.log", progress)]
    group._read_progress(group.procs[0])
    assert group.newest()["step"] == 43  # what a heartbeat would show without the sticky NaN
    found = group.take_nonfinite()
    assert found["step"] == 42 and found["loss"] != found["loss"]  # NaN
    assert group.take_nonfinite() is None  # once: the next heartbeat shows the newest step again


def test_the_first_step_of_an_incarnation_is_news_once(tmp_path):
    progress = tmp_path / "rank4.progress.jsonl"
    progress.write_text('{"state": "running", "time": 0.5}\n{"restored_step": 41, "time": 0.6}\n')
    group = reader()
    group.procs = [RankProcess(4, 0, None, tmp_path / "rank4.log", progress)]
    group._read_progress(group.procs[0])
    assert not group.first_step_news  # restored, not yet trained
    with open(progress, "a") as f:
        f.write('{"step": 42, "loss": 3.0, "time": 1.0}\n')
    group._read_progress(group.procs[0])
    assert group.first_step_news
    group.first_step_news = False  # a heartbeat carried it
    with open(progress, "a") as f:
        f.write('{"step": 43, "loss": 2.9, "time": 2.0}\n')
    group._read_progress(group.procs[0])
    assert not group.first_step_news
