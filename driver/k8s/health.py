"""Which of a job's nodes the operator evicts, from what Kubernetes says about their pods and machines,
and which machines it cordons.

The driver judges nodes by their heartbeats; Kubernetes often knows sooner, and why: a pod that
ended, a pod deleted behind the job's back, a machine whose kubelet stopped reporting (NotReady).
The operator turns these into the same eviction request `megascale evict` makes, and the driver
does the rest (a spare takes the node's ranks, a new spare is started, all ranks restart together).

Many failures at once are not a node fault: when more nodes fail together than the job has spares
(every executor lost Redis, say), or the job has already evicted as many machines as it runs on,
the operator holds back and leaves the job to the driver, rather than cordon healthy machines.

Cordoning takes a machine from everyone, so a job's word is not enough: a job's image can crash its
own pods, and its nodeSelector picks the machines they land on. The operator cordons a machine only
when the driver evicted a node after that node failed its self-check, only within the job's node
pool, and at most spec.cordonBudget machines per job per hour.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..state import JobRecord

CORDON_WINDOW_S = 3600.0  # spec.cordonBudget counts the machines a job had cordoned within this window
SELFCHECK_FAILED = "self-check failed"  # how driver/recovery/selfcheck.py words a failed self-check in recovery.bad


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


def cordons(rec: JobRecord, host_of: Callable[[str], Optional[str]], cordoned: dict[str, float],
            machines: dict[str, dict], pool: dict[str, str], budget: int,
            now: float) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Machines to cordon now (machine -> (node, why)), and those refused (machine -> why not).
    `host_of(node)`: the machine an evicted node ran on; `cordoned`: machine -> when, for this job;
    `pool`: labels a machine must carry."""
    recent = sum(1 for t in cordoned.values() if now - t < CORDON_WINDOW_S)
    todo: dict[str, tuple[str, str]] = {}
    refused: dict[str, str] = {}
    for node, why in sorted((rec.recovery.bad if rec.recovery else {}).items()):
        slot, host = rec.slot(node), host_of(node)
        if slot is None or slot.role != "evicted" or not why.startswith(SELFCHECK_FAILED) or not host \
                or host in cordoned or host in todo:
            continue
        labels = ((machines.get(host) or {}).get("metadata") or {}).get("labels") or {}
        if host not in machines or any(labels.get(k) != v for k, v in pool.items()):
            refused[host] = (f"outside the job's node pool ({', '.join(f'{k}={v}' for k, v in sorted(pool.items()))})"
                             if host in machines else "no such machine")
        elif recent + len(todo) >= budget:
            refused[host] = f"{why}, but spec.cordonBudget={budget} machines were cordoned within the hour already"
        else:
            todo[host] = (node, why)
    return todo, refused
