"""What to do once a faulty incarnation's ranks are stopped and its suspects checked (MegaScale §4.2):
restart (evicting dead and failed nodes for hot spares), wait in Paused for a human, or give up; and
which straggler finding, if any, is sure enough to evict a node for.
"""
from __future__ import annotations

from typing import Iterable, Literal, Optional

from megascale.config import ControlConfig, JobConfig

from ..metrics.stragglers import Finding
from ..recovery_record import Recovery
from ..state import JobRecord

Decision = Literal["restart", "pause", "fail"]


def decide(rec: JobRecord, recovery: Recovery, dead: list[str], cfg: JobConfig) -> tuple[Decision, str]:
    """The decision and its one-line reason. `dead`: nodes gone silent; `recovery.bad`: nodes that failed
    their self-check (node -> why). With control.auto_recover the driver evicts both before restarting."""
    fault, bad = recovery.fault, recovery.bad
    if dead and not cfg.control.auto_recover:
        node = dead[0]
        return "pause", (f"node {node} is dead ({fault.message if fault.node == node else 'unresponsive'}); "
                         f"`megascale evict {rec.job} {node}` replaces it with a spare, "
                         f"then `megascale resume {rec.job}`")
    if fault.kind == "evicted":
        return "restart", f"{fault.message}; restarting with the replacement"
    gone = sorted(set(dead) | set(bad))
    named = ", ".join(f"{n} ({bad.get(n, 'dead')})" for n in gone)
    what = f"; evicting {named}" if gone else ""
    if fault.kind == "selfcheck_failed":  # the end of the recovery that restarted before checking: not a restart more
        return "restart", f"{fault.message}{what}; restarting with the replacement"
    if rec.restarts >= cfg.control.max_restarts:
        return "fail", f"{fault.message}{what}; gave up after {rec.restarts} restarts (control.max_restarts)"
    return "restart", f"{fault.message}{what}; restart {rec.restarts + 1}/{cfg.control.max_restarts}"


def evictions(rec: JobRecord, recovery: Recovery, dead: list[str], cfg: JobConfig) -> dict[str, str]:
    """The nodes a restart evicts for spares, and why: under control.auto_recover, the dead and the failed.
    One evicted already is left out: a driver killed after saving an eviction decides again when restarted."""
    if not cfg.control.auto_recover:
        return {}
    return {n: recovery.bad.get(n) or f"dead ({rec.slot(n).dead})" for n in sorted(set(dead) | set(recovery.bad))
            if (slot := rec.slot(n)) is not None and slot.role != "evicted"}


def straggler_to_evict(findings: Iterable[Finding], control: ControlConfig) -> Optional[Finding]:
    """The finding `control.evict_stragglers` acts on: at `straggler_evict_confidence` or more at each of
    its last `straggler_evict_after` judged steps, and on one node (a stage spread over several nodes names
    no node to replace). The most confident, then the slowest, of those."""
    after = control.straggler_evict_after
    sure = [f for f in findings if len(f.trail) >= after and min(f.trail[-after:]) >= control.straggler_evict_confidence
            and len(f.nodes) == 1]
    return max(sure, key=lambda f: (f.confidence, f.slowdown), default=None)
