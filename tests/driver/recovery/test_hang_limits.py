"""How long silence and standstill may last before they are faults: the hang limit follows the job's own
step intervals, a validation is not a hang, and a node is not declared dead while no node at all is heard
(a broker restart). The end-to-end hang recovery is in test_recovery.py."""
from __future__ import annotations

import time
from typing import Optional

from megascale.common.messages import Heartbeat
from megascale.config import from_dict
from megascale.driver.backend import NodeInfo
from megascale.driver.ingest import NodeView
from megascale.driver.recovery import HangClock, Liveness
from megascale.driver.reconcile import Driver
from megascale.driver.state import JobRecord, JobState, NodeSlot


def config(**control):
    return from_dict({"name": "j", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                      "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2}, "train": {"steps": 1000},
                      "cluster": {"nodes": 2}, "control": control})


def record() -> JobRecord:
    rec = JobRecord(job="j", config={}, run_dir="/r", incarnation=1,
                    nodes=[NodeSlot(f"n{i}", "active", i) for i in range(2)])
    rec.entered = time.time() - 3600
    return rec


def clock_after_steps(rec: JobRecord, seconds_per_step: list[float], ago: float) -> HangClock:
    """A clock that saw steps 0, 1, ... taking `seconds_per_step`, the last one `ago` seconds ago."""
    clock, at = HangClock(), time.time() - ago - sum(seconds_per_step)
    clock.track(rec, {"step": 0, "seen": at}, [])
    for step, took in enumerate(seconds_per_step, start=1):
        at += took
        clock.track(rec, {"step": step, "seen": at}, [])
    return clock


def check(clock: HangClock, rec: JobRecord, cfg, waits=()):
    return clock.check(rec, cfg, {"step": clock.step}, list(waits), lambda message, node: None)


def test_the_hang_limit_is_the_ceiling_until_step_intervals_are_known_then_a_multiple_of_the_slowest():
    rec, cfg = record(), config()
    assert (cfg.control.hang_after_s, cfg.control.hang_after_steps) == (120.0, 5.0)
    warming = clock_after_steps(rec, [1.0, 1.0], ago=60)  # two intervals: not yet known
    assert warming.limit(cfg) == (120.0, "control.hang_after_s") and check(warming, rec, cfg) is None
    clock = clock_after_steps(rec, [1.0, 1.6, 0.9, 1.0], ago=7)
    limit, setting = clock.limit(cfg)
    assert abs(limit - 8.0) < 1e-6 and "hang_after_steps=5 x the slowest recent step, 1.60 s" in setting
    assert check(clock, rec, cfg) is None  # 7 s still: within 8 s
    fault = check(clock_after_steps(rec, [1.0, 1.6, 0.9, 1.0], ago=9), rec, cfg)
    assert fault.kind == "hang" and "no training progress for 9 s after step 4" in fault.message
    assert "limit 8 s: control.hang_after_steps" in fault.message


def test_a_hang_is_found_at_its_limit_not_a_heartbeat_later_nor_from_late_heartbeats():
    rec, cfg = record(), config()  # limit 6 s (dead_after_s) for 0.1-s steps; heartbeats every 2 s
    clock = clock_after_steps(rec, [0.1] * 5, ago=6.3)

    def hang(age_s: float, heard_ago: float):
        seen = {"step": clock.step, "age_s": age_s, "heard": time.time() - heard_ago}
        return clock.check(rec, cfg, seen, [], lambda message, node: None)

    # the last heartbeat, 1.8 s ago, said the step was 4.5 s old: it is 6.3 s old now, over the limit
    assert hang(4.5, 1.8).kind == "hang"
    assert hang(4.5, 1.0) is None  # 5.5 s old: within it
    # a node 10 s quiet whose last word was a 1-s-old step: its heartbeats are late (dead_after_s's
    # case), not its training; the word is carried forward one heartbeat period at most
    assert hang(1.0, 10.0) is None


def test_the_adaptive_limit_is_never_under_dead_after_s_nor_over_the_ceiling_and_can_be_turned_off():
    rec = record()
    fast = clock_after_steps(rec, [0.1] * 5, ago=0)
    assert fast.limit(config())[0] == 6.0  # 5 x 0.1 s, raised to dead_after_s
    slow = clock_after_steps(rec, [30.0] * 5, ago=0)
    assert slow.limit(config()) == (120.0, "control.hang_after_s")  # 150 s: the ceiling is sooner
    assert fast.limit(config(hang_after_steps=0)) == (120.0, "control.hang_after_s")


def test_a_restart_keeps_the_intervals_but_a_shrink_forgets_them():
    rec, cfg = record(), config()
    clock = clock_after_steps(rec, [2.0] * 5, ago=0)
    rec.incarnation = 2
    clock.track(rec, {"step": 3, "seen": time.time() + 30}, [])  # restored to step 3: no interval across it
    assert list(clock.intervals) == [2.0] * 5 and clock.limit(cfg)[0] == 10.0
    rec.incarnation, rec.dp = 3, 1  # shrunk to dp 1: each step does twice the work
    clock.track(rec, {"step": 3, "seen": time.time() + 40}, [])
    assert clock.limit(cfg) == (120.0, "control.hang_after_s")


def test_a_validation_holds_the_clock_for_the_ceiling_not_the_adaptive_limit():
    rec, cfg = record(), config()
    clock = clock_after_steps(rec, [1.0] * 5, ago=40)
    validating = [(time.time() - 40, "validation after step 5", "n0")]
    assert check(clock, rec, cfg, validating) is None  # 40 s into it: over 5 x 1 s, but a validation
    fault = check(clock, rec, cfg, [(time.time() - 130, "validation after step 5", "n0")])
    assert fault.kind == "hang" and "waited 130 s for validation after step 5" in fault.message
    assert "control.hang_after_s" in fault.message


class Processes:
    """A backend's executor list; every node alive until a test says otherwise."""
    def __init__(self, alive: Optional[dict] = None):
        self.alive = alive or {}

    def list(self):
        return {n: NodeInfo(n, alive, "h", "pid 1") for n, alive in self.alive.items()}


def view(node: str, silent_s: float) -> NodeView:
    hb = Heartbeat(job="j", node=node, host="h", ip="127.0.0.1", boot_id="b", seq=1, time=time.time() - silent_s,
                   interval_s=2.0, phase="running", incarnation=1, step=5)
    return NodeView(hb, received=time.monotonic() - silent_s, wall=time.time() - silent_s)


def test_a_silent_node_is_dead_after_dead_after_s_unless_no_node_is_heard_at_all():
    cfg = config()
    views = {"n0": view("n0", 7.0), "n1": view("n1", 1.0)}
    liveness = Liveness(views, Processes(), cfg)
    liveness.started -= 60
    assert liveness.gone("n0") and not liveness.gone("n1")  # 7 s silent, 6 s allowed: n1 is heard
    views["n1"] = view("n1", 7.0)  # now nobody is heard: the broker, likelier than both nodes
    assert liveness.nobody_heard() and not liveness.gone("n0") and not liveness.gone("n1")
    views["n0"] = view("n0", 19.0)  # ... but not for ever: 3 x dead_after_s
    assert liveness.gone("n0") and not liveness.gone("n1")


def test_an_executor_exit_is_seen_within_a_second_and_at_once_when_asked_fresh():
    processes = Processes({"n0": True, "n1": True})
    liveness = Liveness({"n0": view("n0", 0.0), "n1": view("n1", 0.0)}, processes, config())
    assert liveness.exited() == set()
    processes.alive["n0"] = False  # kill -9 of n0's executor, right after the last look
    assert liveness.exited() == set() and not liveness.gone("n0")  # the look is cached for up to 1 s ...
    assert liveness.exited(fresh=True) == {"n0"} and liveness.gone("n0")  # ... `resume` does not rely on it


class CountingLiveness:
    def __init__(self):
        self.fresh_looks = 0

    def exited(self, fresh: bool = False):
        self.fresh_looks += fresh
        return set()


class WaitingRecoverer:
    def resume(self, rec):
        return "waiting for the replacement node to report"


def test_a_resumed_job_looks_afresh_at_exited_executors_once_per_resume_not_per_waiting_tick():
    driver = Driver.__new__(Driver)  # only the paused state's parts: no Redis, no backend
    driver.liveness, driver.recoverer = CountingLiveness(), WaitingRecoverer()
    driver.event = lambda *args, **kwargs: None
    driver._resume_looked = False
    rec = record()
    rec.state = JobState.PAUSED
    for _ in range(5):  # `resume` asked; five ticks waiting for the replacement node (a Kubernetes list each)
        driver._paused(rec, "running")
    assert driver.liveness.fresh_looks == 1
    driver._paused(rec, "paused")  # paused again, then resumed again: one more look
    driver._paused(rec, "running")
    driver._paused(rec, "running")
    assert driver.liveness.fresh_looks == 2
