"""`megascale bench stragglers`: does the straggler detector name the slow rank, how soon, and how often
does it name a healthy one, on the main example's shape (examples/gpt-tiny.yaml: 8 ranks, tp2 pp2 dp2)?

What runs:
1. A live run: the main example's model, layout and optimizer train on this host (8 gloo ranks on its
   CPUs, synthetic batches) for `LEAD` steps, then `LIVE_FAULTS` times: one rank (a different one each
   time, at random) slowed by a random factor for `FAULT_STEPS` steps by `megascale chaos slow-rank`'s
   throttle (executor/throttle.py: SIGSTOP/SIGCONT in a duty cycle), then `GAP` fault-free steps. Each
   fault is a live trial.
2. Replayed trials from that run's fault-free steps: `TRIALS` fault-free and `TRIALS` faulted ones. Each
   is the run's warm-up steps, then steps drawn in blocks of `BLOCK` consecutive fault-free steps (a
   block bootstrap: this host's noise as it was, its step-to-step correlation kept): `TRIAL_STEPS` of
   them, or for a faulted trial `ONSET` steps and then `FAULT_STEPS` with one rank slowed: its compute
   times the factor, its peers' waits longer by as much (the ranks step in lockstep). The slow rank
   cycles through all 8 positions (every tp, dp and pp coordinate); the factor is drawn from 1.3-3 in
   every other trial and from 1.3-1.5 in the rest, so the hardest band has enough trials to measure.
Every trial's records go through the driver's own StragglerMonitor step by step, and the eviction policy
(control.evict_stragglers with control.straggler_evict_after and straggler_evict_confidence) acts on its
findings, as in the driver.

Keys: `recall`: faulted trials whose slow rank was named within `detect_steps` (10) steps of the onset,
its onset step included (also per factor band); `precision`: findings naming the slow rank / all findings
in faulted trials from the onset on; `false_positives_per_10k_rank_steps`: findings in fault-free trials
per 10,000 judged rank-steps; `detect_steps_median`: steps from the onset to the naming, over the trials
drawn from 1.3-3 (named within FAULT_STEPS); `wrong_evictions`: evictions of a node not hosting the slow
rank (any eviction in a fault-free trial).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import yaml

from megascale.config import ControlConfig, JobConfig, from_dict
from megascale.driver.metrics.stragglers import Finding, StragglerMonitor, Thresholds, peer_ratios, segment_value
from megascale.driver.recovery.policy import straggler_to_evict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt-tiny.yaml"
DETECT_STEPS = 10  # a slow rank counts as found when named within this many steps of its onset (the goal)
FAULT_STEPS = 24  # steps a fault lasts: findings after DETECT_STEPS still count for precision
LEAD = 5 + 40  # warm-up, then fault-free steps before the first live fault
GAP = 24  # fault-free steps after each live fault (its finding clears before the next)
LIVE_FAULTS, LIVE_FAULTS_QUICK = 6, 1
TRIALS, TRIALS_QUICK = 96, 16
TRIAL_STEPS = 80  # judged steps of a fault-free trial
ONSET = (32, 48)  # judged steps before a replayed onset (drawn): the detector has learned the job's pace
BLOCK = 8
FACTORS = ((1.3, 3.0), (1.3, 1.5))  # alternating: the range, and its hardest part
BANDS = ((1.3, 1.5), (1.5, 3.0))
GOALS = {"recall_1.5-3.0": 0.95, "recall_1.3-1.5": 0.8, "precision": 0.95,
         "false_positives_per_10k_rank_steps": 1.0, "wrong_evictions": 0, "detect_steps_median": 10}
AT_LEAST = ("recall_1.5-3.0", "recall_1.3-1.5", "precision")


def main_example(steps: int) -> JobConfig:
    """The main example's model, layout and optimizer, on synthetic batches (no corpus to prepare)."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    return from_dict({**{k: raw[k] for k in ("model", "parallelism", "batch", "optimizer", "cluster")},
                      "train": {"steps": steps}})


# -- the live run -----------------------------------------------------------------------------

def _train_rank(ctx, cfg: JobConfig, folder: str) -> list[dict]:
    from megascale.train import Trainer

    Path(folder, f"pid{ctx.rank}").write_text(str(os.getpid()))
    trainer = Trainer(cfg, ctx)
    out = []
    try:
        for _ in range(cfg.train.steps):
            out.append(trainer.step().timings)
            if ctx.rank == 0:
                Path(folder, "step").write_text(str(out[-1]["step"]))
        trainer.finish()
    finally:
        trainer.close()
    return out


def _throttle_on_schedule(folder: Path, plan: list[tuple[int, int, float]], done: threading.Event) -> None:
    """For each (onset, rank, factor): throttles that rank's process through steps onset .. onset + FAULT_STEPS - 1."""
    from megascale.executor.throttle import Throttle

    def reached(step: int) -> bool:
        try:
            return int((folder / "step").read_text() or 0) >= step
        except (FileNotFoundError, ValueError):
            return False

    for onset, rank, factor in plan:
        while not reached(onset - 1) and not done.is_set():
            time.sleep(0.02)
        throttle = Throttle(int((folder / f"pid{rank}").read_text()), factor, until=time.time() + 3600).start()
        while not reached(onset + FAULT_STEPS - 1) and not done.is_set():
            time.sleep(0.02)
        throttle.stop()


def record(cfg: JobConfig, plan: list[tuple[int, int, float]] = ()) -> list[dict]:
    """Every rank's step timings of one run of `cfg`, with the slow ranks of `plan`."""
    from megascale.launch import run_ranks
    from megascale.train import layout_of

    with tempfile.TemporaryDirectory(prefix="megascale-bench-stragglers-") as tmp:
        done = threading.Event()
        slow = threading.Thread(target=_throttle_on_schedule, args=(Path(tmp), list(plan), done), daemon=True)
        slow.start()
        try:
            per_rank = run_ranks(_train_rank, layout_of(cfg), cfg, tmp, backend="gloo",
                                 sequence_parallel=cfg.parallelism.sequence_parallel)
        finally:
            done.set()
            slow.join()
    return [r for records in per_rank for r in records]


# -- trials ------------------------------------------------------------------------------------

def achieved(steps: list[dict[int, dict]], rank: int) -> float:
    """How much slower the throttle made `rank`: its compute over its TP peers' (who wait for it), the
    median over `steps`."""
    ratios = [value / tp_ref for ranks in steps
              for value, _, tp_ref in [peer_ratios(ranks, "compute")[rank]] if tp_ref]
    return round(statistics.median(ratios), 3) if ratios else 1.0


def by_step(records: list[dict]) -> list[dict[int, dict]]:
    steps: dict[int, dict[int, dict]] = {}
    for r in records:
        steps.setdefault(r["step"], {})[r["rank"]] = r
    return [steps[s] for s in sorted(steps)]


def slow_down(ranks: dict[int, dict], rank: int, factor: float) -> dict[int, dict]:
    """One step with `rank`'s process running `factor` times slower, as the chaos throttle makes it: its
    compute and its waits on its TP peers (it is stopped when their data arrives) take `factor` times as
    long, and so do its forward and backward, which hold both. The rest wait for it in lockstep: its TP
    peers inside their forward and backward (their TP group's pace is its pace), then on the group they
    share with it, narrowest first. (Live runs of the throttle measure its TP group's forward + backward
    at 0.5-1.0 x log(factor) above the other DP replica's: BENCHMARKS.md.)"""
    me = ranks[rank]
    own = me["segments"]
    work = own.get("forward", 0.0) + own.get("backward", 0.0)
    extra = (factor - 1.0) * (segment_value(me, "compute") + own.get("exposed_tp", 0.0))
    out = {}
    for k, r in ranks.items():
        segments = dict(r["segments"])
        if k == rank:
            for name in ("forward", "backward", "exposed_tp"):
                segments[name] = segments.get(name, 0.0) * factor
        else:
            kind = "tp" if (r["pp"], r["dp"]) == (me["pp"], me["dp"]) else "dp" if r["pp"] == me["pp"] else "pp"
            in_tp = (factor - 1.0) * work
            waits = {"tp": in_tp, "dp": extra - in_tp} if kind == "tp" else {kind: extra}
            for on, seconds in waits.items():
                segments[f"exposed_{on}"] = segments.get(f"exposed_{on}", 0.0) + seconds
            if kind == "tp":
                segments["forward"] = segments.get("forward", 0.0) + waits["tp"]
        out[k] = {**r, "total": r["total"] + extra, "segments": segments}
    return out


def bootstrap(rng: random.Random, warmup: list[dict[int, dict]], clean: list[list[dict[int, dict]]],
              length: int) -> list[dict[int, dict]]:
    """`warmup`, then `length` steps in blocks of BLOCK consecutive steps of the `clean` segments (a segment
    drawn by its length), renumbered to follow on."""
    weights = [max(0, len(s) - BLOCK + 1) for s in clean]
    drawn = list(warmup)
    while len(drawn) < len(warmup) + length:
        segment = rng.choices(clean, weights)[0]
        start = rng.randrange(len(segment) - BLOCK + 1)
        drawn += segment[start:start + BLOCK]
    return [{k: {**r, "step": i + 1} for k, r in ranks.items()} for i, ranks in enumerate(drawn[:len(warmup) + length])]


class Trial:
    """One trial's records through a fresh StragglerMonitor step by step, with the eviction policy."""

    def __init__(self, ranks_per_node: int, control: ControlConfig, thresholds: Thresholds = Thresholds()):
        self.monitor = StragglerMonitor(ranks_per_node, thresholds=thresholds)
        self.control, self.ranks_per_node = control, ranks_per_node
        self.eviction: Optional[tuple[int, Finding]] = None  # (step, the finding it evicted on)
        self.judged_rank_steps = 0

    def run(self, steps: list[dict[int, dict]]) -> "Trial":
        for i, ranks in enumerate(steps):
            self.monitor.update(ranks.values())
            self.judged_rank_steps += len(ranks) if i >= self.monitor.thresholds.warmup_steps else 0
            if self.eviction is None and (f := straggler_to_evict(self.monitor.findings(), self.control)):
                self.eviction = (i + 1, f)
        return self

    def score(self, slow: Optional[int], onset: int = 0, end: Optional[int] = None) -> dict:
        """Findings reported from `onset` to `end` (fault-free: all), whether and when the slow rank was
        named (alone: not as part of its TP group or stage), and whether an eviction took the wrong node."""
        found = [f for f in self.monitor.reported if onset <= f.since and (end is None or f.since < end)]
        right = [f for f in found if f.ranks == [slow]]
        evicted = self.eviction[1] if self.eviction and onset <= self.eviction[0] < (end or 1 << 30) else None
        wrong = evicted is not None and (slow is None or evicted.nodes != [slow // self.ranks_per_node])
        return {"findings": len(found), "right": len(right),
                "detected": min((f.since - onset + 1 for f in right), default=None), "wrong_eviction": wrong}


def replayed_trials(warmup: list[dict[int, dict]], clean: list[list[dict[int, dict]]], trials: int,
                    ranks_per_node: int, control: ControlConfig, seed: int = 0,
                    thresholds: Thresholds = Thresholds()) -> tuple[list[dict], list[dict]]:
    """(fault-free trials' scores, faulted trials' scores)."""
    rng = random.Random(seed)
    world = sorted(warmup[0])
    fault_free, faulted = [], []
    for i in range(trials):
        trial = Trial(ranks_per_node, control, thresholds).run(bootstrap(rng, warmup, clean, TRIAL_STEPS))
        fault_free.append({**trial.score(None), "rank_steps": trial.judged_rank_steps})
        rank, drawn = world[i % len(world)], FACTORS[i % len(FACTORS)]
        factor = round(rng.uniform(*drawn), 3)
        onset = len(warmup) + rng.randint(*ONSET) + 1
        stream = bootstrap(rng, warmup, clean, onset - 1 - len(warmup) + FAULT_STEPS)
        stream = stream[:onset - 1] + [slow_down(s, rank, factor) for s in stream[onset - 1:]]
        trial = Trial(ranks_per_node, control, thresholds).run(stream)
        faulted.append({**trial.score(rank, onset), "rank": rank, "factor": factor, "drawn": list(drawn)})
    return fault_free, faulted


def summary(fault_free: list[dict], faulted: list[dict]) -> dict:
    def recall(scores: list[dict]) -> Optional[float]:
        hits = [s for s in scores if s["detected"] is not None and s["detected"] <= DETECT_STEPS]
        return round(len(hits) / len(scores), 3) if scores else None

    findings = sum(s["findings"] for s in faulted)
    rank_steps = sum(s["rank_steps"] for s in fault_free)
    drawn = [s for s in faulted if s.get("drawn", list(FACTORS[0])) == list(FACTORS[0])]
    detected = [s["detected"] for s in drawn if s["detected"] is not None]
    return {"recall": recall(faulted),
            **{f"recall_{lo}-{hi}": recall([s for s in faulted if lo <= s["factor"] < hi or s["factor"] == hi])
               for lo, hi in BANDS},
            "precision": round(sum(s["right"] for s in faulted) / findings, 3) if findings else None,
            "false_positives_per_10k_rank_steps":
                round(1e4 * sum(s["findings"] for s in fault_free) / rank_steps, 2) if rank_steps else None,
            "detect_steps_median": statistics.median(detected) if detected else None,
            "wrong_evictions": sum(s["wrong_eviction"] for s in fault_free + faulted)}


def meets(result: dict) -> bool:
    return all(result.get(k) is not None and (result[k] >= goal if k in AT_LEAST else result[k] <= goal)
               for k, goal in GOALS.items())


def run(args: argparse.Namespace) -> dict:
    quick = bool(getattr(args, "quick", False))
    rng = random.Random(1)
    control, thresholds = ControlConfig(evict_stragglers=True), Thresholds()
    faults = LIVE_FAULTS_QUICK if quick else LIVE_FAULTS
    probe = main_example(1)
    ranks_per_node, world = probe.ranks_per_node, probe.parallelism.world_size
    plan = [(LEAD + 1 + i * (FAULT_STEPS + GAP), rank, round(rng.uniform(*FACTORS[i % 2]), 3))
            for i, rank in enumerate(rng.sample(range(world), faults))]
    cfg = main_example(LEAD + faults * (FAULT_STEPS + GAP))
    started, load = time.monotonic(), [round(os.getloadavg()[0], 1)]
    steps = by_step(record(cfg, plan))
    recorded_s = time.monotonic() - started
    load.append(round(os.getloadavg()[0], 1))

    live = Trial(ranks_per_node, control, thresholds).run(steps)
    ends = [onset for onset, _, _ in plan[1:]] + [len(steps) + 1]
    live_scores = [{**live.score(rank, onset, end), "rank": rank, "factor": factor,
                    "achieved": achieved(steps[onset - 1:onset - 1 + FAULT_STEPS], rank)}
                   for (onset, rank, factor), end in zip(plan, ends)]
    warmup = steps[:thresholds.warmup_steps]
    faulted_steps = {s for onset, _, _ in plan for s in range(onset, onset + FAULT_STEPS)}
    clean, segment = [], []
    for i, ranks in enumerate(steps[len(warmup):], start=len(warmup) + 1):
        if i in faulted_steps:
            clean, segment = clean + [segment] if segment else clean, []
        else:
            segment.append(ranks)
    clean = [s for s in clean + [segment] if len(s) >= BLOCK]
    fault_free, faulted = replayed_trials(warmup, clean, TRIALS_QUICK if quick else TRIALS, ranks_per_node,
                                          control, thresholds=thresholds)
    result = {**summary(fault_free, faulted), "detect_steps": DETECT_STEPS, "fault_steps": FAULT_STEPS,
              "live": {**{k: v for k, v in summary([], live_scores).items()
                          if k.startswith(("recall", "precision", "detect"))}, "faults": live_scores},
              "trials": {"fault_free": len(fault_free), "faulted": len(faulted), "live": len(live_scores),
                         "judged_rank_steps_fault_free": sum(s["rank_steps"] for s in fault_free)},
              "run": {"steps": len(steps), "fault_free_steps": sum(map(len, clean)), "seconds": round(recorded_s, 1),
                      "load_average": load,
                      "step_s_median": round(statistics.median(
                          statistics.median(r["total"] for r in s.values()) for s in steps), 3)},
              "shape": {"ranks": world, "ranks_per_node": ranks_per_node,
                        **{d: getattr(cfg.parallelism, d) for d in ("tp", "pp", "dp")}},
              "goals": GOALS, "quick": quick}
    result["meets_goals"] = meets(result)
    return result
