"""Faults and what to do about them: the seam where automatic recovery grows.

Today: a failed rank restarts the ranks (up to control.max_restarts); a dead node pauses the
job with a message saying how to replace it (`megascale evict`, then `resume`). MegaScale's
full loop — diagnose suspects, evict the failures, take spares, restart — replaces
`RecoveryPolicy.decide` and adds detectors to `detect_faults`, without touching the driver.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from megascale.config import JobConfig

from .ingest import NodeView
from .state import JobRecord

Decision = Literal["restart", "pause", "fail"]


@dataclass
class Fault:
    kind: str  # node_dead | rank_failed | ranks_stopped | start_failed | unresponsive | evicted
    node: Optional[str]
    message: str  # one line for `status` and the events topic
    detail: dict = field(default_factory=dict)


def detect_faults(rec: JobRecord, views: dict[str, NodeView], silence: Callable[[str], float],
                  cfg: JobConfig) -> list[Fault]:
    """Faults among the active nodes of the current incarnation, most serious first."""
    faults = []
    for slot in rec.slots("active"):
        quiet = silence(slot.node)
        if quiet > cfg.control.dead_after_s:
            faults.append(Fault("node_dead", slot.node, f"node {slot.node}: no heartbeat for {quiet:.1f} s"))
            continue
        view = views.get(slot.node)
        if view is None or view.hb.incarnation != rec.incarnation:
            continue
        for r in view.hb.ranks:
            if r.state == "failed":
                errors = [e.line for e in view.hb.errors if e.rank == r.rank]
                why = f": {errors[-1]}" if errors else ""
                faults.append(Fault("rank_failed", slot.node, f"rank {r.rank} on {slot.node} exited with code "
                                    f"{r.exit_code}{why}", {"rank": r.rank, "exit_code": r.exit_code}))
                break
            if r.state == "stopped":
                faults.append(Fault("ranks_stopped", slot.node, f"rank {r.rank} on {slot.node} was stopped "
                                    f"outside the driver's control", {"rank": r.rank}))
                break
    return faults


class RecoveryPolicy:
    def decide(self, rec: JobRecord, fault: Fault, dead: list[str], cfg: JobConfig) -> tuple[Decision, str]:
        """What to do once the ranks of the faulty incarnation are stopped; returns (decision, reason)."""
        if dead:
            node = dead[0]
            return "pause", (f"node {node} is dead ({fault.message if fault.node == node else 'unresponsive'}); "
                             f"`megascale evict {rec.job} {node}` replaces it with a spare, then `megascale resume {rec.job}`")
        if fault.kind == "evicted":
            return "restart", f"{fault.message}; restarting with the replacement"
        if rec.restarts >= cfg.control.max_restarts:
            return "fail", f"{fault.message}; gave up after {rec.restarts} restarts (control.max_restarts)"
        return "restart", f"{fault.message}; restart {rec.restarts + 1}/{cfg.control.max_restarts}"
