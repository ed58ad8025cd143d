"""`megascale bench recovery --real`: real GPT ranks in the main example's shape; each fault recovered by the
driver, its timeline split into phases, the issue's goals judged, and every loss equal to an uninterrupted run."""
from __future__ import annotations

import argparse

import pytest

from megascale.bench import recovery as bench_recovery
from megascale.bench.recovery_real import goals, split


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


@pytest.mark.slow
def test_quick_real_recovery_bench_recovers_a_killed_rank_and_a_nan_loss_exactly(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASCALE_HOME", str(tmp_path / "home"))  # the bench points it at its own job
    real = bench_recovery.run(argparse.Namespace(real=True, quick=True, fault_interval=0.0))["real"]
    assert set(real["lost_s_by_kind"]) == {"kill-rank", "nan-loss"}
    assert real["mttr_split"]["kill-rank"]["recoveries"] == ["rank_failed"]
    assert real["mttr_split"]["nan-loss"]["recoveries"] == ["nan_loss"]
    for kind, phases in real["mttr_split"].items():
        assert all(phases[p] >= 0 for p in ("detect_s", "diagnose_s", "restart_s", "catchup_s")), (kind, phases)
        assert 0 < real["lost_s_by_kind"][kind] < 120, (kind, real)
    assert real["replayed_steps_max"] >= 0 and set(real["goals"]) == {
        "killed_rank_lost_s", "dead_node_with_spare_lost_s", "replayed_steps_max"}
    assert real["loss_equal_to_uninterrupted"], real
    assert real["loss_steps_compared"] == real["steps"] > 0
