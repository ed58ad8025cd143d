"""`megascale bench recovery --quick`: the JSON keys the issue tracks across runs, and sane values."""
from __future__ import annotations

import argparse

import pytest

from megascale.bench import recovery as bench_recovery


@pytest.mark.slow
def test_quick_recovery_bench_reports_every_fault_and_the_tracked_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASCALE_HOME", str(tmp_path / "home"))
    result = bench_recovery.run(argparse.Namespace(quick=True, fault_interval=0.0))
    assert {"detection_intervals_max", "resume_s_max", "lost_s_per_fault_max", "ettr", "fault_interval_s",
            "faults"} <= set(result)
    assert [f["kind"] for f in result["faults"]] == ["rank_failed", "node_dead", "hang"]
    for fault in result["faults"]:
        assert 0 <= fault["detection_s"] < 10 and fault["total_s"] > 0 and fault["steps_lost"] >= 0, fault
    assert result["resume_s_max"] < 30 and 0 < result["ettr"] < 1
    assert result["detection_intervals_by_kind"]["node_dead"] <= 2  # the executor's exit, seen by the backend
    # The heartbeat saying the step went stale leaves at hang_after_s, not at the next interval.
    assert result["hang_detection_past_threshold_s"] < 1.5 * bench_recovery.HEARTBEAT_S
    assert len(result["driver_rss_mb"]) == 3 and all(v > 0 for v in result["driver_rss_mb"])
    assert result["driver_rss_mb_per_100_recoveries"] is None  # 3 faults: no settled span to fit
    assert result["evicted"] == 1 and len(result["job_record_kb"]) == 3  # kill-node evicts its node
    assert all(1 < kb < 20 for kb in result["job_record_kb"]) and result["job_record_kb_per_100_recoveries"] is None


def test_growth_is_fitted_over_the_second_half_past_two_cycles_of_fault_kinds():
    one_time = [100.0, 104.0, 110.0, 111.0, 120.0, 121.0] + [121.0] * 10 + [134.0] * 10  # first uses: left out
    settled = [134.0 + 0.02 * i for i in range(30)]  # 0.02 MB a recovery
    assert bench_recovery.per_100_recoveries(one_time + settled, cycle=3) == pytest.approx(2.0, abs=0.01)
    assert bench_recovery.per_100_recoveries(one_time + [None] * 30, cycle=3) is None
    assert bench_recovery.per_100_recoveries(settled[:12], cycle=5) is None


def test_a_job_that_ended_early_fails_the_benchmark_in_one_line(monkeypatch):
    import redis

    from megascale.bench import BenchFailed

    class GoneRedis:
        def get(self, key):
            raise redis.ConnectionError("Connection refused")

    store = argparse.Namespace(r=GoneRedis(), k_status="status")
    final = argparse.Namespace(final={"state": "Failed", "reason": "restarts exhausted (10)"})
    monkeypatch.setattr(bench_recovery.JobHandle, "load", staticmethod(lambda job: final))
    ended = r"^the job ended before the benchmark did: Failed restarts exhausted \(10\)$"
    with pytest.raises(BenchFailed, match=ended):
        bench_recovery._job_status(store)
