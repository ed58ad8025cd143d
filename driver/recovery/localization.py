"""Hang localisation (MegaScale §5.2): from every rank's flight recorder (read by its executor, as the
rank may be blocked in a collective or stopped), the ranks the others are waiting for: ranks that never
entered the operation a stuck peer is in, and are not themselves waiting on anyone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from megascale.common.flight_format import NO_PEER, OpRecord
from megascale.common.messages import Ack
from megascale.config import JobConfig
from megascale.parallel.layout import Layout, groups_to_create

from ..recovery_record import Fault, Recovery
from ..state import JobRecord


@dataclass
class HangReport:
    suspects: list[int]  # ranks the job is waiting for
    waiting: dict[int, str]  # stuck rank -> what it waits in
    reason: str


def localize_hang(records: dict[int, list[OpRecord]], group_members: dict[str, list[int]],
                  halted: Optional[dict[int, str]] = None) -> HangReport:
    """Names the rank(s) the others are stuck waiting for: those that never entered the operation a stuck
    peer is in, and those the OS shows halted (`halted`: rank -> process state, e.g. "stopped"), which
    may have entered it before they stopped, so that only the OS knows better than their records.

    `group_members` maps each group name (as recorded) to its global ranks.
    """
    halted = halted or {}

    def entered(rank: int, group: str, peer: int) -> int:
        return max((r.seq for r in records.get(rank, []) if r.group == group and r.peer == peer), default=0)

    def blocks(member: int, group: str, peer: int, seq: int) -> bool:
        return member in halted or entered(member, group, peer) < seq

    waits_for: dict[int, set[int]] = {}
    waiting: dict[int, str] = {}
    for rank, ops in records.items():
        stuck = next((r for r in ops if r.ended is None), None)
        if stuck is None or rank in halted:  # a halted rank waits on nobody: it is the one not moving
            continue
        waiting[rank] = (f"{stuck.op} #{stuck.seq} on {stuck.group}"
                         + (f" with rank {stuck.peer}" if stuck.peer >= 0 else ""))
        if stuck.peer >= 0:  # P2P: the peer's matching operation on the same group, towards us
            blockers = {stuck.peer} if blocks(stuck.peer, stuck.group, rank, stuck.seq) else set()
        else:
            blockers = {m for m in group_members.get(stuck.group, []) if m != rank
                        and blocks(m, stuck.group, NO_PEER, stuck.seq)}
        waits_for[rank] = blockers
    # The root causes wait on nobody themselves (stopped, dead, or stuck outside communication).
    suspects = sorted({b for blockers in waits_for.values() for b in blockers if not waits_for.get(b)})
    stopped = ", ".join(f"rank {r}: {halted[r]}" for r in suspects if r in halted)
    if not waiting:
        return HangReport([], {}, "no rank is inside a communication operation")
    if not suspects:
        return HangReport([], waiting, "every stuck rank's peers entered the operation: a network or library hang")
    return HangReport(suspects, waiting, f"rank(s) {suspects} never entered the operation their peers wait in"
                      + (f" (the OS shows {stopped})" if stopped else ""))


def group_members(tp: int, pp: int, dp: int) -> dict[str, list[int]]:
    """Every communication group of the job by its flight-recorder name ("<kind>:<first member>")."""

    layout, groups = Layout(tp, pp, dp), {}
    for rank in range(tp * pp * dp):
        for kind, members in groups_to_create(layout, rank):
            groups[f"{kind}:{members[0]}"] = list(members)
    return groups


def peers_of(ranks: set[int], groups: dict[str, list[int]]) -> set[int]:
    """Ranks sharing any multi-rank group with `ranks` (the ones a broken link would also show up on)."""
    return {m for members in groups.values() if len(members) > 1 and ranks & set(members) for m in members}


def localize(rec: JobRecord, recovery: Recovery, cfg: JobConfig,
             acks: dict[str, Ack]) -> tuple[str, HangReport, list[str]]:
    """Reads the flight records the executors acknowledged the `flight` command with; names the node(s) holding
    the rank(s) the others wait for as the recovery's suspects, and the first of them as the fault's node.
    Returns the one-line finding, the report and the nodes."""
    records: dict[int, list[OpRecord]] = {}
    halted: dict[int, str] = {}
    for node, seq in rec.waiting.items():
        ack = acks.get(node)
        if ack is None or ack.seq != seq or not ack.ok:
            continue
        detail = json.loads(ack.detail or "{}")
        halted.update({int(rank): str(state) for rank, state in detail.pop("halted", {}).items()})
        for rank, ops in detail.items():
            if isinstance(ops, list):  # else {"error": why this rank has no records}
                records[int(rank)] = [OpRecord(**op) for op in ops]
    p, rpn = cfg.parallelism, cfg.ranks_per_node
    report = localize_hang(records, group_members(p.tp, p.pp, p.dp), halted)
    index = {s.index: s.node for s in rec.slots("active")}
    nodes = sorted({index[r // rpn] for r in report.suspects if r // rpn in index})
    waiting = ", ".join(f"rank {r}: {w}" for r, w in sorted(report.waiting.items())[:4])
    if nodes:
        message = f"hang localised to {', '.join(nodes)}: {report.reason}" + (f" ({waiting})" if waiting else "")
        fault = recovery.fault
        recovery.fault = Fault("hang", nodes[0], f"{fault.message}; {message}",
                               {**fault.detail, "suspect_ranks": report.suspects})
    else:
        message = f"hang not localised: {report.reason}; checking every node"
    recovery.suspects = nodes
    return message, report, nodes
