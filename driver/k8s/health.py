"""Which of a job's nodes the operator evicts, from what Kubernetes says about their pods and machines.

The driver judges nodes by their heartbeats; Kubernetes often knows sooner, and why: a pod that
ended, a pod deleted behind the job's back, a machine whose kubelet stopped reporting (NotReady).
The operator turns these into the same eviction request `megascale evict` makes, and the driver
does the rest (a spare takes the node's ranks, a new spare is started, all ranks restart together).

Many failures at once are not a node fault: when more nodes fail together than the job has spares
(every executor lost Redis, say), or the job has already evicted as many machines as it runs on,
the operator holds back and leaves the job to the driver, rather than cordon healthy machines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..state import JobRecord


@dataclass
class Verdict:
    evict: dict[str, str] = field(default_factory=dict)  # node id -> why, to request now
    held: str = ""  # why nothing is evicted although nodes failed


def ready(machine: dict) -> bool:
    """False only when the node says it is not Ready (a missing condition is no evidence)."""
    for cond in (machine.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return True


def failed_nodes(rec: JobRecord, pods: dict[str, dict], machines: dict[str, dict],
                 missing_s: Callable[[str], float], grace_s: float) -> dict[str, str]:
    """Nodes in service whose pod ended, went, or sits on a NotReady machine; `missing_s(node)` says
    how long its pod has been missing (it may not have been created yet)."""
    failed = {}
    for slot in rec.nodes:
        if slot.role == "evicted" or not slot.started:
            continue
        pod = pods.get(slot.node)
        if pod is None:
            if missing_s(slot.node) > grace_s:
                failed[slot.node] = f"its pod is gone (missing for {missing_s(slot.node):.0f} s)"
            continue
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        host = (pod.get("spec") or {}).get("nodeName")
        if status.get("phase") in ("Failed", "Succeeded"):
            failed[slot.node] = f"pod {name} {status['phase'].lower()}{_termination(status)}"
        elif pod["metadata"].get("deletionTimestamp"):
            failed[slot.node] = f"pod {name} is being deleted"
        elif host and host in machines and not ready(machines[host]):
            failed[slot.node] = f"node {host} of pod {name} is NotReady"
    return failed


def _termination(status: dict) -> str:
    for cs in status.get("containerStatuses") or []:
        ended = (cs.get("state") or {}).get("terminated")
        if ended:
            why = ended.get("reason") or ""
            return f" (exit code {ended.get('exitCode')}{', ' + why if why else ''})"
    return f" ({status['reason']})" if status.get("reason") else ""


def silent_nodes(rec: JobRecord) -> dict[str, str]:
    """Active nodes the driver declared dead (it pauses the job and asks for an eviction)."""
    return {s.node: f"no heartbeat ({s.dead})" for s in rec.slots("active") if s.dead}


def judge(failed: dict[str, str], requested: set[str], spares: int, evicted_hosts: int, nodes: int) -> Verdict:
    """What to evict now: every failed node not yet requested, unless the failure looks job-wide."""
    if not failed:
        return Verdict()
    if len(failed) > max(1, spares):
        return Verdict(held=f"{len(failed)} nodes failed at once ({_list(failed)}), more than spec.spares={spares}: "
                            f"not evicting automatically")
    if evicted_hosts >= nodes:
        return Verdict(held=f"{evicted_hosts} machines evicted already, as many as spec.nodes={nodes}: not evicting "
                            f"{_list(failed)} automatically")
    return Verdict(evict={n: why for n, why in failed.items() if n not in requested})


def _list(failed: dict[str, str]) -> str:
    shown = [f"{n}: {why}" for n, why in sorted(failed.items())[:3]]
    return "; ".join(shown) + ("; ..." if len(failed) > 3 else "")
