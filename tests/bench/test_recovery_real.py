"""`megascale bench recovery --real`: how a fault's recoveries are summed into its phases and judged against the
goals. The benchmark itself (8 real GPT ranks, several minutes) is a command, not a test: its runs are in
BENCHMARKS.md; the same recoveries end to end are tests/driver/recovery/test_restart_in_process.py."""
from __future__ import annotations

import argparse

from megascale.bench import BenchFailed, recovery_real
from megascale.bench.recovery_real import goals, split
from megascale.cli import main


def test_a_fault_costs_its_recoveries_summed_and_goals_without_a_value_are_not_judged():
    first = {"kind": "node_dead", "step": 30, "steps_lost": 1, "detection_s": 15.2, "diagnosis_s": 0.4,
             "restart_s": 3.1, "catchup_s": 0.9, "total_s": 19.6}
    second = {**first, "kind": "rank_failed", "steps_lost": 0, "detection_s": 0.1, "total_s": 4.5}
    assert split({"recoveries": [first, second]}) == {
        "detect_s": 15.3, "diagnose_s": 0.8, "restart_s": 6.2, "catchup_s": 1.8, "lost_s": 24.1,
        "steps_replayed": 1, "recoveries": ["node_dead", "rank_failed"]}
    judged = goals({"kill-rank": 8.5, "nan-loss": 2.0}, replayed=1)
    assert judged["killed_rank_lost_s"] == {"goal": 8.0, "value": 8.5, "met": False}
    assert judged["dead_node_with_spare_lost_s"]["met"] is None  # --quick injects no dead node
    assert judged["replayed_steps_max"]["met"] is True


def test_a_benchmark_that_cannot_finish_says_why_in_one_line(monkeypatch, capsys):
    def never_recovers(args: argparse.Namespace) -> dict:
        raise BenchFailed("timed out after 300 s waiting for the recovery from nan-loss (the job is Running)")
    monkeypatch.setattr(recovery_real, "run", never_recovers)
    assert main(["bench", "recovery", "--real", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == ("megascale bench recovery: timed out after 300 s waiting for the recovery from "
                                 "nan-loss (the job is Running)\n")
