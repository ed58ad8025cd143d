"""Recovery timings (MegaScale §6): each recovery's MTTR in phases, and the job's ETTR.

Per recovery (status `recoveries`, and an `info` event): `detection_s` (fault -> detected),
`diagnosis_s` (-> decision: localisation, stop, self-checks), `restart_s` (-> the new incarnation's
first step), `catchup_s` (-> back at the step of the fault), `steps_lost` (steps replayed), `total_s`.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..ingest import NodeView
from ..recovery_record import Fault, Timeline
from ..state import JobRecord

KEPT = 50  # the newest recoveries the record and the status keep in full


def start(rec: JobRecord, fault: Fault, step: int, chaos: Optional[dict], silence: Callable[[str], float],
          hang_since: float) -> Timeline:
    """The timeline of a fault detected now, at `step` of the current incarnation."""
    now = time.time()
    return Timeline(occurred=_occurred(rec, fault, now, chaos, silence, hang_since), detected=now, step=step,
                    incarnation=rec.incarnation)


def _occurred(rec: JobRecord, fault: Fault, now: float, chaos: Optional[dict], silence: Callable[[str], float],
              hang_since: float) -> float:
    """Best estimate of when the fault happened: an injected one's own record (`chaos`), else the evidence."""
    if chaos and now - 300 < chaos["time"] <= now and chaos["time"] > rec.entered - 1:
        return chaos["time"]
    if fault.kind == "node_dead":
        return now - silence(fault.node or "")
    if fault.kind == "hang":
        return hang_since
    if "at" in fault.detail:  # the error line's or the bad step's own time, by the node's clock
        return min(now, fault.detail["at"])
    return now  # a straggler has no moment of failure: its detection counts from the finding


def track(rec: JobRecord, views: dict[str, NodeView], seen: dict) -> Optional[dict]:
    """Notes the productive seconds since the last step seen (ETTR) and moves the open recovery
    along: the restarted incarnation's first step, then the fault's step again. Returns the recovery's
    figures once caught up."""
    step, step_time = seen.get("step"), seen.get("step_time")
    now = seen.get("seen", time.time())  # when its node saw the step, not when its heartbeat came
    note_progress(rec, step, now)
    recovery = rec.recovery
    t = recovery.timeline if recovery else None
    if recovery is None or t is None or step is None or t.incarnation == rec.incarnation:
        return None
    if t.resumed is None:
        restored = [v.hb.restored_step for s in rec.slots("active") if (v := views.get(s.node))
                    and v.hb.incarnation == rec.incarnation and v.hb.restored_step is not None]
        t.resumed, t.restored_step = now, min(restored) if restored else max(0, step - 1)
        t.step = max(t.step, t.restored_step)  # the fault's step came from a heartbeat up to an interval stale
    if step < t.step:
        return None
    # A heartbeat shows the newest step: the fault's step was reached `step - t.step` steps before it.
    now = max(t.resumed, now - (step - t.step) * (step_time or 0.0))
    diagnosed = t.detected if t.diagnosed is None else t.diagnosed
    phases = {"detection_s": t.detected - t.occurred, "diagnosis_s": diagnosed - t.detected,
              "restart_s": t.resumed - diagnosed, "catchup_s": now - t.resumed, "total_s": now - t.occurred}
    fault = recovery.fault
    done = {"kind": fault.kind, "node": fault.node, "step": t.step, "restored_step": t.restored_step,
            "steps_lost": max(0, t.step - t.restored_step), **{k: round(v, 2) for k, v in phases.items()}}
    if rec.recovered < len(rec.recoveries):  # a record written before the count: its list held every recovery
        rec.recovered, rec.recovery_s = len(rec.recoveries), sum(r["total_s"] for r in rec.recoveries)
    rec.recovered += 1
    rec.recovery_s += done["total_s"]
    done["n"] = rec.recovered
    # Only the newest are kept: the record and the status are rewritten on every pass, and a job that runs for
    # weeks recovers hundreds of times. Each one is also an `info` event, and the count and MTTR cover them all.
    rec.recoveries = [*rec.recoveries[1 - KEPT:], done]
    recovery.timeline = None
    return done


def note_progress(rec: JobRecord, step: Optional[int], seen: float) -> None:
    """Adds to ETTR's productive time the seconds since the last step seen in this incarnation, for the share of
    the steps between them that go past the furthest step the job ever reached: a replayed step trained no new
    data, and the gap before an incarnation's first step (start-up, restart) is no step's. By when the nodes saw
    the steps, not the steps' own step_time: a heartbeat shows whichever step is newest, and a step's time leaves
    out what comes between steps (snapshots, logging)."""
    if step is None:
        return
    last = rec.last_seen_step
    if last is not None and last[0] == rec.incarnation and step > last[1]:
        new_steps = step - max(last[1], rec.furthest_step)
        if new_steps > 0:
            rec.productive_s += max(0.0, seen - last[2]) * new_steps / (step - last[1])
    rec.furthest_step = max(rec.furthest_step, step)
    if last is None or (last[0], last[1]) != (rec.incarnation, step):
        rec.last_seen_step = (rec.incarnation, step, seen)


def summary(done: dict) -> str:
    return (f"recovered from {done['kind']} in {done['total_s']:.1f} s (detect {done['detection_s']:.1f}, "
            f"diagnose {done['diagnosis_s']:.1f}, restart {done['restart_s']:.1f}, catch up {done['catchup_s']:.1f}: "
            f"{done['steps_lost']} steps replayed)")


def mttr(rec: JobRecord) -> Optional[float]:
    """Mean time to recovery: fault to training caught up, over every finished recovery."""
    return round(rec.recovery_s / rec.recovered, 2) if rec.recovered else None


def recovered(status: dict) -> int:
    """How many recoveries a job's status says have finished, ever."""
    return status.get("recovered") or 0


def recoveries_after(status: dict, n: int) -> list[dict]:
    """The status's recoveries numbered above `n` (those finished since `recovered` read `n`), oldest first."""
    return [r for r in status.get("recoveries") or [] if r.get("n", 0) > n]


def ettr(rec: JobRecord) -> Optional[float]:
    """Effective training time ratio: the time that trained new steps over the wall time since submission, until
    now or the job's end (Meta's ETT%, ByteRobust's ETTR). Start-up, detection, diagnosis, restart and replayed
    steps count as lost; a slow step does not (that is throughput: tokens/s and the straggler findings). Not
    iterations x an ideal step time / wall time: on a shared or noisy host no fault-free run keeps its best pace,
    and a fault-free 400-step main example read 0.83 that way (0.95 now: the rest is its 17 s start-up)."""
    if not rec.furthest_step:
        return None
    wall = (rec.entered if rec.terminal else time.time()) - rec.created
    return round(min(1.0, rec.productive_s / max(1e-9, wall)), 4)
