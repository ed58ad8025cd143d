"""`megascale bench recovery --real [--quick]`: what recovery costs with real ranks, end to end.

The main example's shape, as `megascale bench soak` runs it (its `launched_job`: 2 nodes x 4 GPT ranks,
tp2·pp2(vpp2)·dp2, + a spare, the full control plane with the product's control defaults), takes one fault of
each kind, each once the job trains again and its spare reports:

  kill-rank      kill -9 of one rank
  nan-loss       the reporting rank's next step report says NaN (`megascale chaos nan-loss`)
  hang-rank      SIGSTOP of one rank
  kill-executor  kill -9 of a node's executor; its ranks die with it (a lost node: a spare takes its place)
  freeze-node    SIGSTOP of a whole node, executor first, then every process under it (silent: declared dead,
                 a spare takes its place); thawed once replaced, so its processes see the stop they were sent

Before each fault, every node has its warm standby processes (control.standby_ranks), as in a job that has
trained a while. `--quick` (the test): kill-rank and nan-loss. Per fault, the driver's own timeline of its recoveries
(driver/recovery/timings.py): detect, diagnose, restart, catch-up (back at the step of the fault), steps
replayed; time lost is fault to caught up. Then an uninterrupted `megascale train` of the same job to the same
step: every step's final loss must equal it. First, alone on the CPUs, `model_start_s`: what an in-process
restart saves by keeping a rank's model and optimizer (kept_model_start).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from megascale.bench import BenchFailed
from megascale.config import from_dict
from megascale.driver.chaos import ChaosError, executor_pid, standby_pids
from megascale.driver.recovery.timings import recovered, recoveries_after
from megascale.driver.state import JobState

from .recovery import wait_for
from .soak import Soak, launched_job, losses_against_uninterrupted

# (fault, the active node it hits by slot order; nan-loss hits the reporting rank's node, whichever it is)
FAULTS = (("kill-rank", 0), ("nan-loss", None), ("hang-rank", 1), ("kill-executor", 0), ("freeze-node", 1))
QUICK = ("kill-rank", "nan-loss")
DEAD_NODE = ("kill-executor", "freeze-node")
# issue 18's goals: seconds lost end to end per killed rank and per dead node with a spare; steps replayed
GOALS = {"killed_rank_lost_s": 8.0, "dead_node_with_spare_lost_s": 20.0, "replayed_steps_max": 1}
PHASES = {"detect_s": "detection_s", "diagnose_s": "diagnosis_s", "restart_s": "restart_s", "catchup_s": "catchup_s"}
RECOVERY_TIMEOUT_S = 300.0
KEPT_MODEL = {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": 32000, "seq": 256}  # GPT-2 small
KEPT_MODEL_QUICK = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 1024, "vocab": 4096, "seq": 64}


def _settled(soak: Soak, recoveries_before: int) -> list[dict]:
    """The recoveries since `recoveries_before` once the newest finished, the job trains 2 steps past it and
    every spare reports (the next fault may need one; a spare still starting would also compete for the CPUs
    with the next recovery); until then an empty list."""
    status = soak.status()
    done = recoveries_after(status, recoveries_before)
    spares = [n for n in status.get("nodes", []) if n["role"] == "spare"]
    settled = (bool(done) and status.get("state") == JobState.RUNNING.value
               and (status.get("step") or 0) >= done[-1]["step"] + 2 and all(n["alive"] for n in spares))
    return done if settled else []


def _warm(soak: Soak) -> bool:
    """Whether every node has its warm standby processes (executor/standby.py), as a settled job has:
    control.standby_ranks on an active node, ranks_per_node on a spare."""
    rec = soak.store.load()
    cfg = from_dict(rec.config)
    per_node = cfg.control.standby_ranks
    try:
        return all(len(standby_pids(soak.store, slot.node)) >= (per_node if role == "active" else cfg.ranks_per_node)
                   for role in ("active", "spare") for slot in rec.slots(role)) if per_node else True
    except ChaosError:  # a node between its executors
        return False


def _node_at(soak: Soak, index: int) -> str:
    return sorted(soak.store.load().slots("active"), key=lambda s: s.index)[index].node


def _freeze_node(soak: Soak, node: str) -> tuple[str, list[psutil.Process]]:
    """SIGSTOP of the executor (recorded: the moment of the fault), then of every process under it."""
    done = soak.inject("freeze-node", node)
    frozen = psutil.Process(executor_pid(soak.store, node)).children(recursive=True)
    for proc in frozen:
        try:
            proc.suspend()
        except psutil.Error:
            continue
    return f"{done}; stopped its {len(frozen)} processes too", frozen


def _thaw(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.Error:
            continue


def inject_each(soak: Soak, faults: list[tuple[str, int | None]]) -> list[dict]:
    """One fault of each kind in turn, each once the previous one's recovery settled; its recoveries' timelines."""
    injected = []
    for kind, index in faults:
        wait_for(lambda: _warm(soak), RECOVERY_TIMEOUT_S, "every node's standby processes")
        node = _node_at(soak, index) if index is not None else None
        before = recovered(soak.status())
        frozen: list[psutil.Process] = []
        if kind == "freeze-node":
            done, frozen = _freeze_node(soak, node)
        else:
            done = soak.inject(kind, node)
        try:
            recoveries = wait_for(lambda: _settled(soak, before), RECOVERY_TIMEOUT_S, f"the recovery from {kind}")
        except BenchFailed as e:
            status = soak.status()
            raise BenchFailed(f"{e} ({done}; the job is {status.get('state')} at step {status.get('step')}, "
                              f"{recovered(status) - before} recoveries since)") from None
        finally:
            _thaw(frozen)
        injected.append({"kind": kind, "done": done, "recoveries": recoveries})
    return injected


def split(fault: dict) -> dict:
    """A fault's time lost and its MTTR phases, summed over the driver's recoveries from it (one, unless the
    recovery itself met a second fault)."""
    recoveries = fault["recoveries"]
    return {**{name: round(sum(r[key] for r in recoveries), 2) for name, key in PHASES.items()},
            "lost_s": round(sum(r["total_s"] for r in recoveries), 2),
            "steps_replayed": max(r["steps_lost"] for r in recoveries),
            "recoveries": [r["kind"] for r in recoveries]}


def goals(lost: dict[str, float], replayed: int) -> dict:
    values = {"killed_rank_lost_s": lost.get("kill-rank"),
              "dead_node_with_spare_lost_s": max((lost[k] for k in DEAD_NODE if k in lost), default=None),
              "replayed_steps_max": replayed}
    return {name: {"goal": goal, "value": values[name], "met": None if values[name] is None else values[name] <= goal}
            for name, goal in GOALS.items()}


def kept_model_start(model: dict) -> dict:
    """Seconds until a rank's model and optimizer are ready for the restore that starts an incarnation: built
    anew (a new process, or control.restart: process) vs kept from the incarnation before (KeptTrainer, an
    in-process restart), one after the other on one rank of `model`. The main example's model builds in ~0.15 s,
    so this uses one of GPT-2 small's size, where what keeping saves shows."""
    from megascale.parallel.topology import single_device_context
    from megascale.train import KeptTrainer, Trainer

    cfg = from_dict({"model": model, "batch": {"micro": 1, "global": 1}, "train": {"steps": 1}})
    began = time.perf_counter()
    trainer = Trainer(cfg, single_device_context())
    built = time.perf_counter() - began
    kept = KeptTrainer()
    kept.keep(trainer)
    began = time.perf_counter()
    kept.take(cfg, single_device_context())
    taken = time.perf_counter() - began
    trainer.close()
    return {"params": trainer.optimizer.param_buffer.numel(), "built_s": round(built, 2), "kept_s": round(taken, 3)}


def run(args: argparse.Namespace) -> dict:
    quick = bool(getattr(args, "quick", False))
    faults = [(kind, index) for kind, index in FAULTS if not quick or kind in QUICK]
    load_before = os.getloadavg()[0]
    started = time.time()
    kept_model = kept_model_start(KEPT_MODEL_QUICK if quick else KEPT_MODEL)  # before the job: alone on the CPUs
    with tempfile.TemporaryDirectory(prefix="megascale-bench-recovery-real-") as tmp:
        with launched_job(Path(tmp), random.Random(18), "recovery --real") as soak:
            wait_for(lambda: soak.step() >= 5, 600, "the first steps")
            injected = inject_each(soak, faults)
        metrics, losses = losses_against_uninterrupted(soak)
    by_kind = {f["kind"]: split(f) for f in injected}
    lost = {kind: s["lost_s"] for kind, s in by_kind.items()}
    replayed = max(s["steps_replayed"] for s in by_kind.values())
    met = goals(lost, replayed)
    return {"real": {
        "lost_s_by_kind": lost,
        "replayed_steps_max": replayed,
        "mttr_split": {kind: {k: v for k, v in s.items() if k != "lost_s"} for kind, s in by_kind.items()},
        **losses,
        "model_start_s": kept_model,
        "goals": met,
        "meets_goals": losses["loss_equal_to_uninterrupted"] and all(g["met"] for g in met.values()
                                                                     if g["met"] is not None),
        "injected": [f["done"] for f in injected],
        "steps": max((m["step"] for m in metrics), default=0),
        "step_s_median": round(statistics.median(m["step_time"] for m in metrics), 3) if metrics else None,
        "seconds": round(time.time() - started, 1),
        "quick": quick,
        "cpus": os.cpu_count(),
        "load_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # before and after: a shared machine
    }}
