"""Self-checks before a restart (MegaScale §4.3): the live suspects and every node sharing a communication
group with them run the diagnostics suite (the `diagnose` command); a node that fails it is evicted, one
that passes is kept.
"""
from __future__ import annotations

import json
from typing import Callable, Optional

from megascale.config import JobConfig

from ..state import JobRecord, Recovery
from .localization import group_members, peers_of


def targets(rec: JobRecord, recovery: Recovery, cfg: JobConfig, gone: Callable[[str], bool]) -> list[str]:
    """Live suspects (else the fault's node, else every node) and the nodes sharing a group with them;
    none when recovery is manual, self-checks are off, or the user evicted the node already."""
    ctl, fault = cfg.control, recovery.fault
    if not (ctl.auto_recover and ctl.selfcheck) or fault.kind == "evicted":
        return []
    suspects = set(recovery.suspects) or ({fault.node} if fault.node else {s.node for s in rec.slots("active")})
    rpn, p = cfg.ranks_per_node, cfg.parallelism
    index = {s.index: s.node for s in rec.slots("active")}
    ranks = {r for s in rec.slots("active") if s.node in suspects
             for r in range(s.index * rpn, (s.index + 1) * rpn)}
    peers = {index.get(r // rpn) for r in peers_of(ranks, group_members(p.tp, p.pp, p.dp))}
    return sorted(n for n in (suspects | peers) - {None}
                  if not rec.slot(n).dead and not gone(n))  # type: ignore[arg-type]


def request(cfg: JobConfig, inject: dict) -> dict:
    """The `diagnose` command's arguments; `inject`: self-check faults a chaos test planted on the node."""
    checks = [c.strip() for c in cfg.control.selfcheck_checks.split(",") if c.strip()]
    return {"budget_s": cfg.control.selfcheck_budget_s, "checks": checks, "ranks_per_node": cfg.ranks_per_node,
            "inject": inject}


def judge(rec: JobRecord, recovery: Recovery, cfg: JobConfig, failed: dict[str, str], unanswered: list[str],
          event: Callable[..., None]) -> bool:
    """Records the answered self-checks: failures in `recovery.bad`, nodes without an answer dead. False while
    a crashed rank's node that failed is checked once more (control.crashed_selfcheck=retry)."""
    fault = recovery.fault
    for node, detail in failed.items():
        why = _failed_checks(detail)
        if why is None:  # the suite itself could not run: not the node's fault, keep it
            event("info", f"self-check on {node} could not run: {detail[:200]}", rec, node=node)
            continue
        crashed = fault.kind in ("rank_failed", "rank_error") and node == fault.node
        if crashed and cfg.control.crashed_selfcheck == "retry" and node not in recovery.rechecked:
            recovery.rechecked.append(node)
            rec.waiting.pop(node, None)  # sent again on the next pass
            event("info", f"self-check failed on {node} ({why}); checking once more", rec, node=node)
            return False
        recovery.bad[node] = f"self-check failed: {why}"
    for node in unanswered:
        rec.slot(node).dead = rec.slot(node).dead or "no self-check result"
    for node in sorted(set(recovery.suspects) - set(recovery.bad) - set(unanswered)):
        event("node", f"{node} passed its self-check: kept", rec, node=node)
    return True


def _failed_checks(detail: str) -> Optional[str]:
    """The failed checks named by a diagnose ack's JSON report; None if the suite could not run at all."""
    try:
        report = json.loads(detail)
    except ValueError:
        return None
    failed = (sorted({f for n in report.get("nodes", []) for f in n.get("failed", [])})
              if isinstance(report, dict) else [])
    return ", ".join(failed) or "failed"
