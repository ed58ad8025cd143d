"""Which of a job's nodes the operator evicts, from what Kubernetes says about their pods and machines,
and which machines it cordons.

The driver judges nodes by their heartbeats; Kubernetes often knows sooner, and why: a pod that
ended (failures.py says why, from the pod's own evidence), a pod deleted behind the job's back, a
machine whose kubelet stopped reporting (NotReady, past spec.nodeNotReadyGraceSeconds). The operator
turns those the cluster caused into the same eviction request `megascale evict` makes, and the driver
does the rest (a spare takes the node's ranks, a new spare is started, all ranks restart together).

Many failures at once are not a node fault: when more nodes fail together than the job has spares
(every executor lost Redis, say), or the job has already evicted as many machines as it runs on,
the operator holds back and leaves the job to the driver, rather than cordon healthy machines.

Cordoning takes a machine from everyone, so a job's word is not enough: a job's image can crash its
own pods, and its nodeSelector picks the machines they land on. The operator cordons a machine only on
evidence of a bad machine: the driver evicted a node after that node failed its self-check, or after
one of its ranks logged a hardware error (an NVIDIA Xid, an uncorrectable ECC error), or pods of
different jobs crashed there (crashes.py); only within the job's node pool, and at most
spec.cordonBudget machines per job per hour.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..state import JobRecord
from .failures import Failure, classify

CORDON_WINDOW_S = 3600.0  # spec.cordonBudget counts the machines a job had cordoned within this window
SELFCHECK_FAILED = "self-check failed"  # how driver/recovery/selfcheck.py words a failed self-check in recovery.bad
HARDWARE_ERROR = "hardware error in its log"  # and a rank's hardware error (selfcheck.HARDWARE_ERROR)
MACHINE_EVIDENCE = (SELFCHECK_FAILED, HARDWARE_ERROR)  # the reasons for an eviction that cordon its machine


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


def track_not_ready(machines: dict[str, dict], since: dict[str, float], now: float) -> None:
    """Keeps `since` (machine -> when this operator first saw it NotReady) up to date. The operator's own
    clock, not the condition's lastTransitionTime: machines' and the operator's clocks may disagree."""
    for name, machine in machines.items():
        if ready(machine):
            since.pop(name, None)
        else:
            since.setdefault(name, now)
    for name in [m for m in since if m not in machines]:
        del since[name]


def failed_nodes(rec: JobRecord, pods: dict[str, dict], machines: dict[str, dict],
                 missing_s: Callable[[str], float], grace_s: float,
                 not_ready_s: Callable[[str], float] = lambda host: 0.0,
                 not_ready_grace_s: float = 0.0) -> dict[str, Failure]:
    """Nodes in service whose pod ended, went, never started, or sits on a machine NotReady for longer
    than `not_ready_grace_s` (a kubelet that misses a few status updates is no failed machine);
    `missing_s(node)` says how long its pod has been missing (it may not have been created yet)."""
    failed: dict[str, Failure] = {}
    for slot in rec.nodes:
        if slot.role == "evicted" or not slot.started:
            continue
        pod = pods.get(slot.node)
        if pod is None:
            if missing_s(slot.node) > grace_s:
                failed[slot.node] = Failure("PodMissing", f"its pod is gone (missing for {missing_s(slot.node):.0f} s)",
                                            blame=False, replace=True)
            continue
        found = classify(pod)
        host = (pod.get("spec") or {}).get("nodeName")
        if found is not None:
            failed[slot.node] = found
        elif host and host in machines and not ready(machines[host]) and not_ready_s(host) > not_ready_grace_s:
            failed[slot.node] = Failure("NodeNotReady", f"node {host} of pod {pod['metadata']['name']} is NotReady "
                                                        f"(for {not_ready_s(host):.0f} s)", blame=True, replace=True)
    return failed


def silent_nodes(rec: JobRecord) -> dict[str, Failure]:
    """Active nodes the driver declared dead (it pauses the job and asks for an eviction)."""
    return {s.node: Failure("NoHeartbeat", f"no heartbeat ({s.dead})", blame=True, replace=True)
            for s in rec.slots("active") if s.dead}


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
        if slot is None or slot.role != "evicted" or not why.startswith(MACHINE_EVIDENCE) or not host \
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
