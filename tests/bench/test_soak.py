"""`megascale bench soak`'s arithmetic (soak_fits: lost time per fault, step-time drift per incarnation, leak
slopes) and its sampling.
(The soak itself runs for minutes with 8 real ranks: a command, recorded in BENCHMARKS.md, not a test.)"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

import megascale.bench.soak as soak_module
from megascale.bench import BenchFailed
from megascale.bench.soak import run, save_samples
from megascale.bench.incarnations import incarnation_memory
from megascale.bench.loader_memory import loader_memory
from megascale.bench.host_probe import host_probe
from megascale.bench.soak_processes import job_processes, life_key, process_kind
from megascale.bench.soak_fits import (cpu_cores_by_kind, file_pages_added, growth_per_100, host_drift, lost_seconds,
                                       process_slopes, restart_ratios, slope_per_hour, step_time_drift,
                                       step_time_follows_host)


def test_lost_time_is_until_training_passes_its_earlier_step_less_those_steps():
    # 1 step/s, fault at t=10 (step 10), stalled until t=20, replays from step 6: back past 10 at t=25 (step 11)
    progress = [(float(t), t) for t in range(11)] + [(20.0 + k, 6 + k) for k in range(8)]
    assert lost_seconds(progress, injected=10.0, step_s=1.0) == pytest.approx(14.0)  # 15 s to gain 1 step
    assert lost_seconds([(float(t), t) for t in range(20)], injected=10.0, step_s=1.0) == 0.0  # never slowed
    assert lost_seconds([(0.0, 5), (11.0, 5)], injected=10.0, step_s=1.0) is None  # never back


def test_the_report_splits_what_ettr_lost_into_start_up_and_faults():
    # launched at t=100, the first step at t=130; a killed rank that cost 6 s, a broker restart 0.5 s, and a
    # fault the run ended before training was back from (counted in not_back, not in the seconds)
    soak = SimpleNamespace(progress=[(100.0, 0), (129.5, 0), (130.0, 1), (200.0, 70), (230.0, 70)], samples=[])
    injected = [{"kind": k, "time": t, "recoveries_before": 0, "done": ""} for k, t in
                (("kill-rank", 150.0), ("restart-broker", 170.0), ("hang-rank", 201.0))]
    final = {"state": "Running", "ettr": 0.8, "recovered": 1,
             "recoveries": [{"n": 1, "kind": "rank_failed", "total_s": 6.0, "detection_s": 0.5, "diagnosis_s": 0.0,
                             "restart_s": 4.5, "catchup_s": 1.0}]}
    metrics = [{"step": s, "loss": 1.0, "step_time": 1.0} for s in range(1, 71)]
    injected[1]["recoveries_before"] = injected[2]["recoveries_before"] = 1
    result = soak_module.report(soak, injected, final, metrics, {}, {}, 120.0)
    assert (result["ettr"], result["start_s"]) == (0.8, 30.0)
    lost = [f["lost_s"] for f in result["injected"]]
    assert lost[0] == 6.0 and lost[2] is None and result["lost_to_faults_s"] == round(6.0 + lost[1], 1)
    # where a recovery's seconds went, by phase; a fault without a recovery has none
    assert [f["phases_s"] for f in result["injected"]] == [
        [{"detection": 0.5, "diagnosis": 0.0, "restart": 4.5, "catchup": 1.0}], [], []]


def test_drift_is_per_run_of_steps_and_ignores_short_ones():
    steady = [{"step": s, "step_time": 1.0} for s in range(1, 101)]
    slowing = [{"step": s, "step_time": 1.0 + (s - 41) * 0.01} for s in range(41, 141)]  # a replay from 41
    short = [{"step": s, "step_time": 9.0} for s in range(20, 40)]
    # the replay's medians of its last and first 9 steps after 5 of warm-up
    assert step_time_drift(steady + slowing + short) == [1.0, pytest.approx(1.95 / 1.09, abs=0.01)]


def test_drift_leaves_out_the_steps_a_fault_slowed_at_once():
    # 1 step/s from t=0; a slow rank doubles steps 190-199 (the last tenth): that is the fault, not a build-up
    run = [{"step": s, "step_time": 2.0 if s >= 190 else 1.0, "timings": {"start": float(s)}} for s in range(200)]
    assert step_time_drift(run) == [2.0]
    assert step_time_drift(run, disturbed=((189.5, 250.0),)) == [1.0]


def test_restart_ratios_tell_a_build_up_a_restart_clears_from_a_host_slowing_down():
    def incarnations(step_time):  # three incarnations of 100 steps, the second and third replaying 20 steps
        return [{"step": s, "step_time": step_time(i * 100 + k, k)}
                for i, first in enumerate((1, 81, 161)) for k, s in enumerate(range(first, first + 100))]
    build_up = incarnations(lambda wall, age: 1.0 + age * 0.005)  # slows with the rank's age, cleared by a restart
    host = incarnations(lambda wall, age: 1.0 + wall * 0.001)  # slows with the wall clock, whatever the restarts
    assert step_time_drift(build_up) == [pytest.approx(1.41, abs=0.01)] * 3
    assert restart_ratios(build_up) == [pytest.approx(1.41, abs=0.01)] * 2
    assert all(d > 1.07 for d in step_time_drift(host))
    assert restart_ratios(host) == [pytest.approx(1.0, abs=0.02)] * 2
    # a restart next to an incarnation too short for a drift has no ratio
    assert restart_ratios(build_up[:100] + build_up[100:130]) == []


def test_host_drift_tells_the_host_slowing_down_from_the_job_building_up():
    # one run of 200 steps of 1 s from t=0 (its tenths: steps 5-23 and 186-204 by wall time), a probe sample
    # every second; the host slows 10% at t=100, the job (on its own) builds up 5% over the run
    def run(step_time):
        return [{"step": s, "step_time": step_time(s), "timings": {"start": float(s)}} for s in range(200)]
    slower_host = [(float(t), 0.010 if t < 100 else 0.011) for t in range(220)]
    steady_host = [(float(t), 0.010) for t in range(220)]
    host_bound = run(lambda s: 1.0 if s < 100 else 1.1)
    assert step_time_drift(host_bound) == [1.1] and host_drift(host_bound, slower_host) == [1.1]
    build_up = run(lambda s: 1.0 + s * 0.00025)
    assert step_time_drift(build_up) == [pytest.approx(1.045, abs=0.005)] and host_drift(build_up, steady_host) == [1.0]
    # a tenth with fewer than 3 probe samples has no host drift; the list stays beside the drifts
    assert host_drift(host_bound, slower_host[:10]) == [None]
    assert host_drift(host_bound[:40], slower_host) == []


def test_how_closely_step_time_follows_the_host_is_fitted_over_windows_of_steps():
    # 1,000 steps of about 1 s; the host's speed wanders slowly by up to 10%, a probe sample every second
    def host(t):
        return 0.008 * (1.0 + 0.1 * math.sin(t / 80.0))

    def run(step_time):
        return [{"step": s, "step_time": step_time(s), "timings": {"start": float(s)}} for s in range(1000)]

    probe = [(float(t), host(t)) for t in range(1100)]
    follows = step_time_follows_host(run(lambda s: (host(s) / 0.008) ** 1.5), probe)
    assert follows == {"windows": 18, "correlation": pytest.approx(1.0, abs=0.01),
                       "elasticity": pytest.approx(1.5, abs=0.05)}
    noise = random.Random(3)
    own = step_time_follows_host(run(lambda s: 1.0 + 0.1 * math.sin(s / 53.0) + noise.uniform(-0.1, 0.1)), probe)
    assert abs(own["correlation"]) < 0.5  # what the job does on its own does not follow the host
    assert step_time_follows_host(run(lambda s: 1.0), probe)["correlation"] is None
    assert step_time_follows_host(run(lambda s: 1.0)[:450], probe) is None  # 7 windows past the warm-up: too few


def test_the_host_probe_runs_at_real_time_priority_as_root_and_stops_with_the_block(tmp_path):
    with host_probe(tmp_path / "probe.txt") as probe:
        deadline = time.monotonic() + 30
        while len(probe.samples()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "megascale.bench.host_probe" in psutil.Process(probe.pid).cmdline()
        assert probe.realtime() == (os.geteuid() == 0)
        if os.geteuid() == 0:
            assert os.sched_getscheduler(probe.pid) == os.SCHED_FIFO
    times = [t for t, _ in probe.samples()]
    assert len(times) >= 3 and all(0.0 < s < 1.0 for _, s in probe.samples())
    assert all(0.5 < b - a < 3.0 for a, b in zip(times, times[1:]))  # one a second
    assert not psutil.pid_exists(probe.pid)  # killed and waited for


def test_cpu_cores_are_per_kind_over_processes_seen_in_both_samples_first_and_last_tenth():
    def sample(t, driver_cpu, rank_cpu, rank_key="r1"):
        return {"time": t, "processes": {"d": {"kind": "driver", "cpu_s": driver_cpu},
                                         rank_key: {"kind": "executor.rank", "cpu_s": rank_cpu}}}
    # the driver's use grows from 0.1 to 0.3 cores (0.8 in the disturbed interval ending at t=90); the rank uses
    # 1 core; the rank replacing it at t=70 has no interval until its second sample
    driver = [0, 1, 2, 3, 4, 5, 6, 9, 12, 20, 23]
    samples = ([sample(10.0 * i, driver[i], 10.0 * i) for i in range(7)]
               + [sample(10.0 * i, driver[i], 10.0 * (i - 7), "r2") for i in range(7, 11)])
    cores = cpu_cores_by_kind(samples, after_s=0.0, disturbed=((85.0, 95.0),))
    assert cores["driver"] == {"first": pytest.approx(0.1), "last": pytest.approx(0.3)}
    assert cores["executor.rank"]["first"] == pytest.approx(1.0)
    assert cpu_cores_by_kind(samples, after_s=85.0)["driver"]["first"] == pytest.approx(0.8)
    assert cpu_cores_by_kind(samples, after_s=85.0, disturbed=((85.0, 95.0),)) == {}  # one interval left


def test_slope_is_fitted_after_the_warm_up_in_units_per_hour():
    samples = [{"time": 1000.0 + 60 * i, "v": 100.0 + (50.0 if i < 5 else 0.01 * i)} for i in range(30)]
    assert slope_per_hour(samples, lambda s: s["v"], after_s=300) == pytest.approx(0.6)  # 0.01 per minute
    assert slope_per_hour(samples[:2], lambda s: s["v"], after_s=0) is None  # too few points to fit


def test_growth_per_incarnation_is_fitted_past_the_heaps_warm_up():
    warm_then_flat = [197.2, 199.0, 201.2, 202.1, 202.6, 202.8, 203.1, 203.1, 203.1, 202.9, 202.8, 203.1]
    assert abs(growth_per_100(warm_then_flat)) < 5.0  # +5.9 MB over its first 6, then flat
    leaking = [200.0 + 0.1 * i for i in range(12)]
    assert growth_per_100(leaking) == pytest.approx(10.0)  # 0.1 MB each incarnation, to the end
    assert growth_per_100(leaking[:4]) is None  # --quick's 4 incarnations: all warm-up, nothing to fit


def test_a_sample_taken_while_a_fault_disturbs_is_left_out_of_the_slope():
    # A flat rank whose memory dips 8 MB for two samples while it rebuilds its model in a restart at minute 6.
    samples = [{"time": 60.0 * i, "v": 230.0 - (8.0 if i in (6, 7) else 0.0) + (0.5 if i % 2 else 0.0)}
               for i in range(30)]
    assert slope_per_hour(samples, lambda s: s["v"], after_s=300) > 5.0  # the return from the dip reads as growth
    assert slope_per_hour(samples, lambda s: s["v"], after_s=300, disturbed=((350.0, 470.0),)) == pytest.approx(
        0.0, abs=0.5)


def test_an_orphaned_process_of_the_job_is_still_sampled_with_its_children():
    # A driver (sh) whose executor (sh) runs a rank (sleep): the driver killed, the executor and its rank live on
    # outside the tree the job's pids lead to, as a killed driver's executors do until the next one adopts them.
    driver = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60 & wait' & wait"])
    try:
        for _ in range(100):
            known = job_processes([driver.pid], {})
            if len(known) == 3:
                break
            time.sleep(0.05)
        executor_and_rank = set(known) - {driver.pid}
        assert len(executor_and_rank) == 2
        driver.kill()
        driver.wait()
        assert job_processes([driver.pid], {}) == {}  # from the job's pids alone: lost
        assert set(job_processes([driver.pid], known)) == executor_and_rank  # still sampled
    finally:  # only what this test started: every child of pytest would include multiprocessing's resource
        driver.kill()  # tracker and fork server, which a later test's diagnostics then find dead
        driver.wait()
        for pid in set(known) - {driver.pid}:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_process_kinds_name_modules_and_binaries():
    assert process_kind(["/venv/bin/python", "-m", "megascale.executor.rank", "spec.json"]) == "executor.rank"
    assert process_kind(["redis-server 127.0.0.1:6379"]) == "redis-server"
    assert process_kind(["/usr/lib/tansu-v0.6.0-510f3e2", "broker"]) == "tansu"


def test_leak_slopes_are_per_process_so_processes_coming_and_going_are_not_leaks():
    # Ranks: one long-lived and flat (200 MB), one growing 6 MB an hour; every 5 minutes a short-lived one
    # of 900 MB comes and goes (a fault's new process). Summed per kind, those would look like a slope.
    samples = []
    for i in range(41):  # every 30 s for 20 minutes
        procs = {"1@0": {"kind": "executor.rank", "rss_mb": 200.0, "fds": 30, "threads": 8},
                 "2@0": {"kind": "executor.rank", "rss_mb": 300.0 + 0.05 * i, "fds": 30, "threads": 8}}
        if i % 10 < 3:
            procs[f"9@{i // 10}"] = {"kind": "executor.rank", "rss_mb": 900.0, "fds": 40, "threads": 9}
        samples.append({"time": 30.0 * i, "processes": procs})
    slopes = process_slopes(samples, "rss_mb", after_s=300, min_span_s=600)
    assert slopes["executor.rank"]["processes"] == 2  # the short-lived ones are not fitted
    assert slopes["executor.rank"]["worst"] == pytest.approx(6.0)  # the growing one: 0.05 MB per 30 s
    assert slopes["executor.rank"]["pooled"] == pytest.approx(3.0)  # one of two growing: half of it
    assert process_slopes(samples, "fds", after_s=300, min_span_s=600)["executor.rank"]["worst"] == pytest.approx(0)


def test_the_pooled_slope_fits_every_process_about_its_own_level_so_wander_averages_out():
    # Four flat ranks at different levels, each wandering ±2 MB its own way over 15 minutes: each alone reads
    # up to ~14 MB/h; fitted together, each about its own level, they read what they share: nothing.
    wander = [(2.0, -2.0, 0.0), (-2.0, 2.0, 0.0), (0.0, -2.0, 2.0), (0.0, 2.0, -2.0)]
    samples = []
    for i in range(61):  # every 30 s for 30 minutes; the wander in thirds of the last 20
        third = min(2, max(0, (i - 20) // 14))
        samples.append({"time": 30.0 * i, "processes": {f"{r}@0": {"kind": "executor.rank",
                                                                    "anon_mb": 230.0 + 5 * r + w[third]}
                                                         for r, w in enumerate(wander)}})
    slopes = process_slopes(samples, "anon_mb", after_s=300, min_span_s=600)["executor.rank"]
    assert slopes["worst"] > 5.0 and slopes["pooled"] == pytest.approx(0.0, abs=0.01)
    leaking = [{"time": s["time"], "processes": {k: {**p, "anon_mb": p["anon_mb"] + 0.05 * n}
                                                 for k, p in s["processes"].items()}}
               for n, s in enumerate(samples)]  # all four 6 MB/h more: the pooled slope sees it
    assert process_slopes(leaking, "anon_mb", 300, 600)["executor.rank"]["pooled"] == pytest.approx(6.0)


def test_a_standby_that_becomes_a_rank_starts_a_new_life():
    """The soak's ranks: warm standbys (263 MB, 1 thread) that became ranks (~400 MB, 25 threads) read as
    212 MB an hour when fitted as one life; split at the activation, each part is flat."""
    standby = ["/venv/bin/python", "-m", "megascale.executor.rank", "--standby"]
    samples = []
    for i in range(61):  # every 30 s for 30 minutes; activated at minute 10
        threads = 1 if i < 20 else 25
        key = life_key(7, 12.5, standby, threads)
        samples.append({"time": 30.0 * i, "processes": {key: {"kind": process_kind(standby), "fds": 3,
                                                               "rss_mb": 263.0 if threads == 1 else 400.0,
                                                               "threads": threads}}})
    assert {k for s in samples for k in s["processes"]} == {"7@12.50/standby", "7@12.50"}
    slopes = process_slopes(samples, "rss_mb", after_s=60, min_span_s=240)
    assert slopes["executor.rank"] == {"pooled": pytest.approx(0.0), "worst": pytest.approx(0.0), "processes": 2}
    assert life_key(7, 12.5, ["/venv/bin/python", "-m", "megascale.executor.rank", "spec.json"], 1) == "7@12.50"


def test_the_raw_samples_are_saved_to_refit_and_a_bad_path_fails_before_the_run(tmp_path):
    samples = [{"time": 30.0 * i, "processes": {"5@1.00": {"kind": "driver", "rss_mb": 300.0 + i, "fds": 9,
                                                            "threads": 9}}} for i in range(41)]
    soak = SimpleNamespace(samples=samples, progress=[(0.0, 1), (30.0, 40)])
    path = tmp_path / "samples.json"
    save_samples(path, soak, injected=[{"kind": "kill-rank", "time": 12.0}], metrics=[{"step": 1, "loss": 2.0}],
                 probe=[(1.0, 0.008)])
    saved = json.loads(path.read_text())
    assert process_slopes(saved["samples"], "rss_mb", 300, 600) == {"driver": {"pooled": pytest.approx(120.0),
                                                                               "worst": pytest.approx(120.0),
                                                                               "processes": 1}}
    assert saved["injected"][0]["kind"] == "kill-rank" and saved["metrics"] == [{"step": 1, "loss": 2.0}]
    assert saved["host_probe"] == [[1.0, 0.008]]
    with pytest.raises(BenchFailed, match=r"^--samples .*/no/samples.json: No such file or directory$"):
        run(argparse.Namespace(quick=True, minutes=0.0, fault_interval=0.0,
                               samples=str(tmp_path / "no" / "samples.json")))


def test_without_the_reference_run_the_losses_are_not_compared_and_none_is_started(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n"
                                                    for s in (1, 2, 3)))
    monkeypatch.setattr(soak_module.JobHandle, "load", lambda job: SimpleNamespace(run_dir=str(tmp_path)))
    soak = SimpleNamespace(root=tmp_path, env={})
    monkeypatch.setattr(soak_module, "reference_losses", lambda root, env, steps: {1: 4.0, 2: 3.0, 3: 2.0 + 1e-3})
    metrics, losses = soak_module.losses_against_uninterrupted(soak)
    assert len(metrics) == 3 and losses["loss_equal_to_uninterrupted"] is False
    assert losses["loss_mismatched_steps"] == [3]

    def no_reference(*_):
        raise AssertionError("the reference run was started")

    monkeypatch.setattr(soak_module, "reference_losses", no_reference)
    metrics, losses = soak_module.losses_against_uninterrupted(soak, compare=False)
    assert len(metrics) == 3 and losses["loss_equal_to_uninterrupted"] is None and losses["loss_steps_compared"] == 0


def test_a_sample_counts_shared_pages_in_rss_but_not_in_anon():
    """A rank's RSS also holds pages it shares (the loader's ring, checkpoint segments, libraries), which come
    and go as they are touched; `anon_mb` is what the process alone holds, where a leak grows."""
    holds_shared = ("import mmap, sys\n"
                    "ring = mmap.mmap(-1, 64 << 20)\n"  # MAP_SHARED: shared memory, as a memfd ring is
                    "ring.write(b'x' * (64 << 20))\n"
                    "print('ready', flush=True)\n"
                    "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", holds_shared], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        soak = soak_module.Soak.__new__(soak_module.Soak)  # only sample(): no job, no store
        soak.processes = lambda: [psutil.Process(child.pid)]
        (use,) = soak.sample()["processes"].values()
        assert use["rss_mb"] - use["anon_mb"] >= 64
        assert use["anon_mb"] < 64
        assert use["shmem_mb"] >= 64  # told apart from file-backed pages, which grow for other reasons
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_file_pages_a_fault_adds_are_split_into_a_processs_first_of_a_kind_and_its_repeats():
    def sample(at: float, file_mb: dict[str, float]) -> dict:
        return {"time": at, "processes": {key: {"kind": "executor.rank", "rss_mb": 100.0 + mb, "anon_mb": 100.0}
                                          for key, mb in file_mb.items()}}

    samples = [sample(0, {"r0": 10, "r1": 10}), sample(30, {"r0": 12, "r1": 14}),  # the first kill: +2, +4
               sample(60, {"r0": 12, "r1": 14}), sample(90, {"r0": 13, "r2": 50}),  # the first hang: +1
               sample(120, {"r0": 13, "r2": 50}), sample(150, {"r0": 13, "r2": 53})]  # a kill again: 0, +3
    injected = [{"kind": "kill-rank", "time": 10}, {"kind": "hang", "time": 70}, {"kind": "kill-rank", "time": 130}]
    # r2 started in the hang's recovery and r1 ended in it: neither lived through it. The second kill is r0's
    # repeat but r2's first kill: first (2 + 4 + 1 + 3) / 4, repeat r0's 0
    expected = {"first": 2.5, "repeat": 0.0, "first_n": 4, "repeat_n": 1}
    assert file_pages_added(samples, injected, settle_s=15) == expected
    assert file_pages_added(samples[:1], injected, settle_s=15) == {"first": None, "repeat": None, "first_n": 0,
                                                                    "repeat_n": 0}
    for later in samples[1:]:  # shared memory the ranks touched across the faults (a replica filled in) is not file
        for use in later["processes"].values():
            use["rss_mb"], use["shmem_mb"] = use["rss_mb"] + 5.0, 5.0
    assert file_pages_added(samples, injected, settle_s=15) == expected


def test_the_loader_is_read_every_thousand_batches_and_leaves_nothing_running():
    before = {p.pid for p in psutil.Process().children()}  # earlier tests' children are theirs to reap
    result = loader_memory(batches=2000)
    assert len(result["anon_mb"]) == len(result["rss_mb"]) == 2 and result["batches_per_s"] > 0
    assert 0 < result["anon_mb"][-1] < result["rss_mb"][-1]
    assert result["anon_mb_per_100k_batches"] is None  # 2 reads: nothing past the warm-up to fit
    assert [p for p in psutil.Process().children() if p.pid not in before] == []


def test_the_incarnations_measure_stops_the_keeper_its_ranks_started():
    """The ranks start their node's checkpoint keeper, which outlives them by design (15 idle minutes); the
    measure's directory is gone when it returns, so the keeper must go with it (it lingered through soaks)."""
    started = time.time()
    result = incarnation_memory(cycles=2, steps=2)
    assert [len(series) for series in result["anon_mb"]] == [len(s) for s in result["file_mb"]] == [2, 2]
    assert all(50 < mb < 400 for series in result["file_mb"] for mb in series)  # libtorch's code, at least

    def keepers() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "create_time"]):
            line = " ".join(p.info["cmdline"] or ())
            if "megascale.checkpoint.keeper" in line and "megascale-bench-incarnations-" in line \
                    and p.info["create_time"] >= started - 1:
                found.append(p)
        return found

    _, alive = psutil.wait_procs(keepers(), timeout=10)  # its socket closes a moment before it exits
    assert alive == []


def test_minutes_and_fault_interval_refuse_nan_inf_and_negatives_in_one_line(capsys, monkeypatch):
    from megascale import cli

    seen = []  # `--minutes nan` passed the `<= 0` check and started a 30-minute soak
    monkeypatch.setattr(soak_module, "run", lambda args: seen.append((args.minutes, args.fault_interval)) or {})
    assert cli.main(["bench", "soak", "--minutes", "0", "--fault-interval", "2.5"]) == 0
    assert seen == [(0.0, 2.5)]  # 0 = the default
    for flag in ("--minutes", "--fault-interval"):
        for bad in ("-1", "nan", "inf", "soon"):
            with pytest.raises(SystemExit) as exit_:
                cli.main(["bench", "soak", flag, bad])
            assert exit_.value.code == 2
            assert capsys.readouterr().err.splitlines()[-1] == \
                f"megascale bench: error: argument {flag}: '{bad}' is not a number >= 0"
