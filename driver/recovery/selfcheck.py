"""Self-checks (MegaScale §4.3): the diagnostics suite (the `diagnose` command) on the nodes a fault points at;
a node that fails it is evicted, one that passes is kept.

Which nodes, and whether the restart waits (`plan`):
- a fault with a known node-local cause (a rank killed by a signal such as the OOM killer's, a CUDA OOM, a NaN
  loss): its node only, beside the restarted ranks;
- a dead node (its executor exited or went silent): that node is the cause and is evicted unchecked (nothing
  answers there); the live nodes sharing a communication group with it are checked beside the restarted ranks;
- a hang localised to suspects: the suspects before the restart, their group peers beside it;
- any other fault, whose cause may lie anywhere (a hang not localised, a timeout, a crash by an exception): the
  live suspects (else the fault's node, else every node) and their group peers, before the restart.
Beside the restart, the restart does not wait: a node that fails opens a recovery of its own (`selfcheck_failed`)
that evicts it. The ranks' start-up (process start, imports, rendezvous, restore) takes longer than the check, so
the check mostly shares the node with ranks that do not compute yet. The nodes checked before it are the likely
culprits, so a restart does not put the job back on a bad node; the rest cost the restart nothing.

Which checks: `control.selfcheck_checks` (GEMM by default). A fault checked before the restart may also be a
link (a pulled cable times the ranks' collectives out): on an emulated network, where each node has a data link
to probe, its check adds `loopback`, which measures that link to its far end (diagnostics/loopback.py), so the
node whose link is down or slow fails and is evicted while its peers pass.

No check at all for a hardware error in a rank's log (an NVIDIA Xid, an uncorrectable ECC error: executor/ranks.py
`hardware_error`): the line is the evidence, the node is bad (`recovery.bad`, worded HARDWARE_ERROR, which the
Kubernetes operator cordons on as it does on a failed self-check) and evicted by the restart.
"""
from __future__ import annotations

import json
import signal
import time
from typing import Callable, Optional

from megascale.config import JobConfig

from ..recovery_record import BackgroundCheck, Fault, Recovery
from ..state import JobRecord, JobStore
from .localization import group_members, peers_of


HARDWARE_ERROR = "hardware error in its log"  # how recovery.bad words a node whose rank logged one


def hardware(fault: Fault) -> bool:
    """A rank logged a hardware error (detection.py): its node is bad without a check."""
    return fault.kind == "rank_error" and fault.detail.get("error") == "hardware_error"


def wanted(fault: Fault, cfg: JobConfig) -> bool:
    """Whether this recovery may self-check a node (before the restart or beside it)."""
    ctl = cfg.control
    return ctl.auto_recover and ctl.selfcheck and fault.kind not in ("evicted", "selfcheck_failed") \
        and not hardware(fault)


def plan(rec: JobRecord, recovery: Recovery, cfg: JobConfig,
         gone: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """(the nodes to check before the restart, the nodes to check beside the restarted ranks): see the module's
    docstring; none when recovery is manual, self-checks are off, or the user evicted the node already."""
    fault = recovery.fault
    if not wanted(fault, cfg):
        return [], []
    if node_local(fault) and (own := _live(rec, recovery, {fault.node} if fault.node else set(), gone)):
        return [], own
    if (fault.kind == "node_dead" or node_local(fault)) and fault.node:  # its node is gone: as a dead node
        return [], _live(rec, recovery, _with_peers(rec, cfg, {fault.node}) - {fault.node}, gone)
    if fault.kind == "hang" and recovery.suspects:  # localised (localization.py): the suspects now
        suspects = set(recovery.suspects)
        return _live(rec, recovery, suspects, gone), _live(rec, recovery, _with_peers(rec, cfg, suspects) - suspects,
                                                           gone)
    suspects = set(recovery.suspects) or ({fault.node} if fault.node else {s.node for s in rec.slots("active")})
    return _live(rec, recovery, _with_peers(rec, cfg, suspects), gone), []


def _with_peers(rec: JobRecord, cfg: JobConfig, nodes: set[str]) -> set[str]:
    """`nodes` and every active node sharing a tp/pp/dp/embedding group with one of their ranks."""
    rpn, p = cfg.ranks_per_node, cfg.parallelism
    index = {s.index: s.node for s in rec.slots("active")}
    ranks = {r for s in rec.slots("active") if s.node in nodes for r in range(s.index * rpn, (s.index + 1) * rpn)}
    peers = {index.get(r // rpn) for r in peers_of(ranks, group_members(p.tp, p.pp, p.dp))}
    return nodes | {n for n in peers if n is not None}


def _live(rec: JobRecord, recovery: Recovery, nodes: set[str], gone: Callable[[str], bool]) -> list[str]:
    """Those of `nodes` a self-check can run on: in service, alive, not found bad already."""
    return sorted(n for n in nodes if _in_service(rec, n) and not gone(n) and n not in recovery.bad)


def _in_service(rec: JobRecord, node: str) -> bool:
    slot = rec.slot(node)
    return slot is not None and slot.role == "active" and not slot.dead


def request(cfg: JobConfig, inject: dict, link_suspect: bool = True) -> dict:
    """The `diagnose` command's arguments; `inject`: self-check faults a chaos test planted on the node;
    `link_suspect`: the fault may be a link's (not a node-local one), so an emulated node's link is probed."""
    checks = [c.strip() for c in cfg.control.selfcheck_checks.split(",") if c.strip()]
    if link_suspect and cfg.cluster.network == "emulated" and "loopback" not in checks:
        checks.append("loopback")
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


# Deaths by these signals come from the node itself (the OOM killer's or a user's SIGKILL, a bad access);
# SIGABRT is left out: the NCCL watchdog aborts the peers of a failed rank with it.
NODE_LOCAL_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def node_local(fault: Fault) -> bool:
    """A fault whose cause is known and on its own node: its self-check can run beside the restarted ranks."""
    if fault.kind == "rank_failed":
        code = fault.detail.get("exit_code")
        return isinstance(code, int) and code < 0 and -code in NODE_LOCAL_SIGNALS  # Popen: -N = killed by N
    return fault.kind == "nan_loss" or (fault.kind == "rank_error" and fault.detail.get("error") == "oom")


def send_later(rec: JobRecord, recovery: Recovery, cfg: JobConfig, store: JobStore) -> None:
    """Starts the checks `plan` put beside the restart, on the nodes still in service after the decision's
    evictions. control.crashed_selfcheck's second check is the fault's own node's: a peer gets none."""
    for node in recovery.later:
        if _in_service(rec, node):
            send_background(rec, cfg, store, node, retried=node != recovery.fault.node)


def send_background(rec: JobRecord, cfg: JobConfig, store: JobStore, node: str, retried: bool = False) -> None:
    """Starts `node`'s self-check beside its ranks: sent before the next `start`, so it runs while they start."""
    args = {**request(cfg, store.take_injection(node), link_suspect=False), "background": True}
    rec.checking[node] = BackgroundCheck(store.send(node, "diagnose", args), time.time(), retried)


def background_fault(rec: JobRecord, cfg: JobConfig, store: JobStore, event: Callable[..., None]) -> Optional[Fault]:
    """Collects the finished background self-checks: a pass keeps the node, a failure is a fault that evicts it
    (or, under control.crashed_selfcheck=retry, checks it once more first)."""
    if not rec.checking:
        return None
    results, ctl = store.selfchecks(), cfg.control
    for node, check in sorted(rec.checking.items()):
        slot, ack = rec.slot(node), results.get(node)
        if slot is None or slot.role != "active":
            del rec.checking[node]  # evicted meanwhile: nothing left to decide
            continue
        if ack is None or ack.seq != check.seq:
            if time.time() - check.sent > ctl.selfcheck_budget_s + ctl.command_timeout_s:
                event("info", f"no result of {node}'s background self-check; kept", rec, node=node)
                del rec.checking[node]
            continue
        del rec.checking[node]
        why = None if ack.ok else _failed_checks(ack.detail)
        if ack.ok:
            event("node", f"{node} passed its background self-check: kept", rec, node=node)
        elif why is None:
            event("info", f"background self-check on {node} could not run: {ack.detail[:200]}", rec, node=node)
        elif ctl.crashed_selfcheck == "retry" and not check.retried:
            event("info", f"background self-check failed on {node} ({why}); checking once more", rec, node=node)
            send_background(rec, cfg, store, node, retried=True)
        else:
            return Fault("selfcheck_failed", node, f"node {node} failed its self-check in the background ({why})",
                         {"why": f"self-check failed: {why}"})
    return None
