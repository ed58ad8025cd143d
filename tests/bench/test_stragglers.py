"""`megascale bench stragglers`'s trials, on a recorded fault-free run of the main example (the live run
itself takes minutes: the benchmark's to run, not the tests')."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from megascale.bench import stragglers as bench
from megascale.config import ControlConfig
from megascale.driver.metrics.stragglers import segment_value

TRACE = Path(__file__).parents[1] / "driver" / "metrics" / "data" / "gpt-tiny-8-ranks.jsonl.gz"


@pytest.fixture(scope="module")
def steps() -> list[dict[int, dict]]:
    with gzip.open(TRACE, "rt") as f:
        return bench.by_step([json.loads(line) for line in f])


def test_a_slowed_step_stays_in_lockstep(steps):
    step = steps[40]
    slowed = bench.slow_down(step, 6, 2.0)
    # The slowed process: its compute twice its own, its forward and backward (its TP waits in them) too.
    assert segment_value(slowed[6], "compute") == pytest.approx(2 * segment_value(step[6], "compute"))
    for name in ("forward", "backward", "exposed_tp"):
        assert slowed[6]["segments"][name] == pytest.approx(2 * step[6]["segments"][name])
    extra = slowed[6]["total"] - step[6]["total"]
    assert extra > 0
    for rank in step:  # every rank's step grows by the same seconds; only the slow rank's compute does
        assert slowed[rank]["total"] == pytest.approx(step[rank]["total"] + extra)
        if rank != 6:
            assert segment_value(slowed[rank], "compute") == pytest.approx(segment_value(step[rank], "compute"))
    # Its TP peer waits inside forward: their TP group's forward + backward grows as the slow rank's does.
    work = [sum(r["segments"][k] for k in ("forward", "backward")) for r in (step[6], slowed[6], slowed[7])]
    assert slowed[7]["segments"]["exposed_tp"] > step[7]["segments"]["exposed_tp"]
    assert work[2] - sum(step[7]["segments"][k] for k in ("forward", "backward")) == pytest.approx(work[1] - work[0])
    assert slowed[4]["segments"]["exposed_dp"] > step[4]["segments"]["exposed_dp"]  # the other DP replica, on DP
    assert slowed[0]["segments"]["exposed_pp"] > step[0]["segments"]["exposed_pp"]  # the other stage, on PP


def test_replayed_trials_on_the_recorded_run_meet_the_goals(steps):
    warmup, clean = steps[:5], [steps[5:]]
    fault_free, faulted = bench.replayed_trials(warmup, clean, 16, 4, ControlConfig(evict_stragglers=True))
    result = bench.summary(fault_free, faulted)
    assert {s["rank"] for s in faulted} == set(range(8))  # every position of tp2 pp2 dp2
    assert all(1.3 <= s["factor"] <= 3.0 for s in faulted)
    assert sum(s["rank_steps"] for s in fault_free) == 16 * bench.TRIAL_STEPS * 8
    assert result["false_positives_per_10k_rank_steps"] == 0 and result["wrong_evictions"] == 0
    # Named within detect_steps (10), alone (not as its TP group): every slow rank at 1.5x or more, 7 of 8
    # at 1.3-1.5x, no healthy rank named.
    assert bench.DETECT_STEPS == 10 and result["recall_1.5-3.0"] == 1.0 and result["recall_1.3-1.5"] >= 0.85
    assert result["precision"] == 1.0 and result["detect_steps_median"] <= 5
    assert bench.meets({**result, "precision": 0.95}) and not bench.meets({**result, "wrong_evictions": 1})


def test_the_main_example_is_the_benchmarks_shape():
    cfg = bench.main_example(10)
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp, cfg.ranks_per_node) == (2, 2, 2, 4)
    assert cfg.data.source == "synthetic" and cfg.train.steps == 10
