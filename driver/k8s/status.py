"""A TrainingJob's status: the driver's record and live status in Kubernetes terms, the machines
evicted, the newest checkpoint, and conditions for `kubectl wait`.

ETTR and MTTR are the driver's own (MegaScale §6: time that trained new steps / wall time; fault to
caught-up), so `megascale status` and `kubectl get trainingjobs` agree. What the driver does not
know after a restart (its last step, loss, ETTR) keeps the value the status held.

The status stays small whatever the job's history (etcd refuses objects over 1.5 MiB): it lists the nodes
in service and the last HISTORY evicted nodes and machines, with totals for the rest (the job's record in
Redis keeps every node).
"""
from __future__ import annotations

import math
import time
from typing import Optional

from megascale.checkpoint.storage import committed_steps, open_storage

from ..state import JobRecord, JobState, JobStatus
from .spec import pod_name

TERMINAL_PHASES = {JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.STOPPED.value}
# Changes to these are written at once; progress (step, loss, ETTR) at most every few seconds.
SIGNIFICANT = ("phase", "reason", "incarnation", "restarts", "paused", "evictedNodes", "nodes", "lastCheckpoint",
               "observedGeneration", "conditions", "nextNode", "recoveries")
HISTORY = 32  # evicted nodes, and evicted machines, the status lists (the newest)
PROGRESS = {"step": "step", "totalSteps": "total_steps", "loss": "loss", "tokensPerSecond": "tokens_per_s",
            "ettr": "ettr", "mttrSeconds": "mttr_s"}


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def build(previous: dict, rec: JobRecord, live: Optional[JobStatus], *, generation: Optional[int], paused: bool,
          evicted_hosts: list[str], hosts: dict[str, str], checkpoint: Optional[dict], extra_conditions: list[dict],
          name: str, now: float) -> dict:
    """The next status, from the previous one (start time, last known progress, condition times)."""
    # A node's machine stays on record after its pod is gone: which machine did the evicted n1 use?
    hosts = {**{n["id"]: n.get("host") for n in previous.get("nodes") or []}, **{n: h for n, h in hosts.items() if h}}
    status: dict = {
        "phase": rec.state.value, "reason": rec.reason, "paused": paused, "incarnation": rec.incarnation,
        "restarts": rec.restarts, "recoveries": rec.recovered, "nextNode": rec.next_node,
        "startTime": previous.get("startTime") or iso(now), "lastSyncTime": iso(now),
        # Never fewer than before but by age: the job's Redis may lose its keys (a flush) between two reads of a pass.
        "evictedNodes": _newest(previous.get("evictedNodes") or [], rec, hosts, evicted_hosts),
        "evictedNodesTotal": max(len(set(evicted_hosts)), previous.get("evictedNodesTotal") or 0),
        "nodes": _nodes(rec, live, hosts, name),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    for key, field in PROGRESS.items():
        value = getattr(live, field, None) if live is not None else None
        if isinstance(value, float) and not math.isfinite(value):
            continue  # a NaN loss (the driver's fault, in `reason`) is not JSON: the API server would refuse it
        if value is not None:
            status[key] = value
        elif key in previous:
            status[key] = previous[key]
    if checkpoint:
        status["lastCheckpoint"] = checkpoint
    status["conditions"] = conditions(previous.get("conditions") or [], rec, generation, extra_conditions, now)
    return status


def _newest(previous: list[str], rec: JobRecord, hosts: dict[str, str], evicted_hosts: list[str]) -> list[str]:
    """The last HISTORY evicted machines: those listed before, then those of the nodes evicted last (in the
    order of their eviction; Redis keeps the machines as a set), then, while there is room, the others."""
    avoided = set(evicted_hosts)
    recent = [h for slot in rec.nodes if slot.role == "evicted" and (h := hosts.get(slot.node)) in avoided]
    found = list(dict.fromkeys([*previous, *recent[-HISTORY:]]))
    room = sorted(avoided - set(found))[:max(0, HISTORY - len(found))]
    return [*found, *room][-HISTORY:]


def _nodes(rec: JobRecord, live: Optional[JobStatus], hosts: dict[str, str], name: str) -> list[dict]:
    """The nodes in service, and the last HISTORY evicted ones."""
    alive = {n.node: n.alive for n in live.nodes} if live else {}
    out = []
    for slot in rec.shown_slots(HISTORY):
        node = {"id": slot.node, "role": slot.role, "pod": pod_name(name, slot.node),
                "alive": alive.get(slot.node, False)}
        if slot.index is not None:
            node["index"] = slot.index
        if hosts.get(slot.node):
            node["host"] = hosts[slot.node]
        if slot.dead:
            node["dead"] = slot.dead
        out.append(node)
    return out


def conditions(previous: list[dict], rec: JobRecord, generation: Optional[int], extra: list[dict],
               now: float) -> list[dict]:
    """Running / Paused / Completed / Failed from the phase, plus the operator's own (Valid, FailedCreateObject,
    EvictionHeld, FailedCreatePod, Unschedulable); a condition keeps its lastTransitionTime while its status
    stays the same. Completed means success, so that `kubectl wait --for=condition=Completed` waits for nothing
    else; a job that failed says so in Failed (a stopped one only in its phase)."""
    phase = rec.state.value
    wanted = [
        {"type": "Running", "status": str(phase == JobState.RUNNING.value), "reason": phase, "message": rec.reason},
        {"type": "Paused", "status": str(phase == JobState.PAUSED.value), "reason": phase, "message": rec.reason},
        {"type": "Completed", "status": str(phase == JobState.SUCCEEDED.value), "reason": phase,
         "message": rec.reason},
        {"type": "Failed", "status": str(phase == JobState.FAILED.value), "reason": phase, "message": rec.reason},
        *extra,
    ]
    before = {c["type"]: c for c in previous}
    out = []
    for cond in wanted:
        old = before.get(cond["type"])
        since = old["lastTransitionTime"] if old and old.get("status") == cond["status"] and old.get(
            "lastTransitionTime") else iso(now)
        out.append({**cond, "lastTransitionTime": since,
                    **({"observedGeneration": generation} if generation is not None else {})})
    return out


def pods_refused(refused: dict[str, str], rec: JobRecord) -> dict:
    """FailedCreatePod: nodes in service whose pod the API server refused (a quota, Pod Security, an invalid
    field), with its message; False again once each is created or evicted."""
    live = sorted(why for node, why in refused.items() if (slot := rec.slot(node)) and slot.role != "evicted")
    return {"type": "FailedCreatePod", "status": str(bool(live)), "reason": "Refused" if live else "Created",
            "message": "; ".join(live)[:2048]}


def changed(old: dict, new: dict) -> bool:
    """Whether the difference is worth a write now rather than at the next progress write."""
    def strip(conds: list[dict]) -> list[tuple]:
        return [(c["type"], c["status"], c.get("reason"), c.get("message")) for c in conds]
    for key in SIGNIFICANT:
        a, b = old.get(key), new.get(key)
        if key == "conditions":
            a, b = strip(a or []), strip(b or [])
        if a != b:
            return True
    return False


def latest_checkpoint(checkpoint: dict) -> Optional[dict]:
    """The newest committed checkpoint under a job's `checkpoint` config, as its status shows it (None: none
    yet); raises what the storage raises. The file system is opened by registered name only."""
    steps = committed_steps(open_storage(checkpoint["uri"], checkpoint.get("filesystem"),
                                         checkpoint.get("filesystem_options")))
    return {"step": steps[-1], "uri": checkpoint["uri"]} if steps else None
