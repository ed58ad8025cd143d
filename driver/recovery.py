"""Faults and what to do about them (MegaScale §4): detect, localise, self-check, evict, replace, restart.

`detect_faults` turns heartbeats into faults; `suspects_of` names the nodes to self-check;
`RecoveryPolicy.decide` takes what the stop and the self-checks found and says whether to
restart (evicting failed nodes for spares), wait in Paused, or give up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from megascale.config import JobConfig

from .ingest import NodeView
from .state import JobRecord

Decision = Literal["restart", "pause", "fail"]

# Error lines that mean the rank is broken even before it exits (a hung NCCL watchdog may never exit).
FATAL_ERRORS = {"nccl_timeout", "cuda_error", "oom"}


@dataclass
class Fault:
    kind: str  # node_dead | rank_failed | ranks_stopped | rank_error | nan_loss | hang | straggler |
               # start_failed | unresponsive | evicted
    node: Optional[str]
    message: str  # one line for `status` and the events topic
    detail: dict = field(default_factory=dict)


def detect_faults(rec: JobRecord, views: dict[str, NodeView], silence: Callable[[str], float],
                  cfg: JobConfig, exited: frozenset[str] | set[str] = frozenset()) -> list[Fault]:
    """Faults among the active nodes of the current incarnation, most serious first.

    `exited`: nodes whose executor the backend saw end (a process, a pod), dead before their heartbeats lapse.
    """
    faults = []
    for slot in rec.slots("active"):
        if slot.node in exited:
            faults.append(Fault("node_dead", slot.node, f"node {slot.node}: its executor exited"))
            continue
        quiet = silence(slot.node)
        if quiet > cfg.control.dead_after_s:
            faults.append(Fault("node_dead", slot.node, f"node {slot.node}: no heartbeat for {quiet:.1f} s"))
            continue
        view = views.get(slot.node)
        if view is None or view.hb.incarnation != rec.incarnation:
            continue
        hb = view.hb
        for r in hb.ranks:
            if r.state == "failed":
                errors = [e.line for e in hb.errors if e.rank == r.rank]
                why = f": {errors[-1]}" if errors else ""
                faults.append(Fault("rank_failed", slot.node, f"rank {r.rank} on {slot.node} exited with code "
                                    f"{r.exit_code}{why}", {"rank": r.rank, "exit_code": r.exit_code}))
                break
            if r.state == "stopped":
                faults.append(Fault("ranks_stopped", slot.node, f"rank {r.rank} on {slot.node} was stopped "
                                    f"outside the driver's control", {"rank": r.rank}))
                break
        else:
            fatal = next((e for e in hb.errors if e.kind in FATAL_ERRORS), None)
            if fatal is not None:
                faults.append(Fault("rank_error", slot.node, f"rank {fatal.rank} on {slot.node} logged "
                                    f"{fatal.kind}: {fatal.line[:160]}",
                                    {"rank": fatal.rank, "error": fatal.kind, "at": fatal.time}))
            elif hb.loss is not None and not math.isfinite(hb.loss):
                faults.append(Fault("nan_loss", slot.node, f"loss is {hb.loss} at step {hb.step} on {slot.node}",
                                    {"step": hb.step, "at": hb.time}))
    return faults


def group_members(tp: int, pp: int, dp: int) -> dict[str, list[int]]:
    """Every communication group of the job by its flight-recorder name ("<kind>:<first member>")."""
    from megascale.parallel.topology import Layout, groups_to_create

    layout, groups = Layout(tp, pp, dp), {}
    for rank in range(tp * pp * dp):
        for kind, members in groups_to_create(layout, rank):
            groups[f"{kind}:{members[0]}"] = list(members)
    return groups


def peers_of(ranks: set[int], groups: dict[str, list[int]]) -> set[int]:
    """Ranks sharing any multi-rank group with `ranks` (the ones a broken link would also show up on)."""
    return {m for members in groups.values() if len(members) > 1 and ranks & set(members) for m in members}


class RecoveryPolicy:
    def decide(self, rec: JobRecord, fault: Fault, dead: list[str], cfg: JobConfig,
               bad: Optional[dict[str, str]] = None) -> tuple[Decision, str]:
        """What to do once the ranks of the faulty incarnation are stopped and suspects checked.

        `dead`: nodes gone silent; `bad`: nodes that failed their self-check (node -> why). With
        control.auto_recover the driver evicts both and takes spares before restarting.
        """
        bad = bad or {}
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
        if rec.restarts >= cfg.control.max_restarts:
            return "fail", f"{fault.message}{what}; gave up after {rec.restarts} restarts (control.max_restarts)"
        return "restart", f"{fault.message}{what}; restart {rec.restarts + 1}/{cfg.control.max_restarts}"
