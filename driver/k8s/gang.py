"""Gang scheduling (spec.scheduling): a job's active pods are placed all together or not at all.

Placed pod by pod, a job can hold some machines' GPUs while its other pods wait for room, and two such
jobs can hold each other's machines for good. A gang scheduler binds none of a job's pods until it can
bind `spec.nodes` of them:

    volcano            a scheduling.volcano.sh/v1beta1 PodGroup (minMember = spec.nodes, spec.queueName as
                       its Queue); pods annotated scheduling.k8s.io/group-name, scheduled by `volcano`
    scheduler-plugins  a scheduling.x-k8s.io/v1alpha1 PodGroup (the coscheduling plugin); pods labelled
                       scheduling.x-k8s.io/pod-group, scheduled by `scheduler-plugins-scheduler`
    kueue              no PodGroup: pods labelled with the LocalQueue (kueue.x-k8s.io/queue-name) as one Kueue
                       pod group of spec.nodes + spec.spares pods, created behind Kueue's admission scheduling
                       gate, which Kueue lifts for the whole group once its quota has room
    none               the cluster's scheduler, pod by pod

Spares ride along: minMember counts the active nodes only, so a spare that does not fit delays nothing.
Kueue needs a fixed count, and a hot spare holds its devices, so there the spares are part of the group.

The PodGroup is the job's (controller ownerReference by UID, ownership.py; the backend creates it before
the pods) and goes with it. A pod the scheduler cannot place says so in its PodScheduled condition
(Unschedulable with the scheduler's message, or SchedulingGated while Kueue queues it): the operator turns
that into the job's `Unschedulable` condition, and the driver, which starts no rank before every active node
reports, names it when its start timeout ends a job whose gang never formed (`never_formed`). Nothing here
evicts a node or blames a machine.
"""
from __future__ import annotations

from typing import Optional

from ..state import JobRecord

SCHEDULING = ("none", "volcano", "scheduler-plugins", "kueue")
POD_GROUP_APIS = {"volcano": ("scheduling.volcano.sh", "v1beta1"),
                  "scheduler-plugins": ("scheduling.x-k8s.io", "v1alpha1")}
POD_GROUPS = "podgroups"
# The scheduler each gang scheduler's stock install runs as (spec.schedulerName names another).
SCHEDULER_NAMES = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}
VOLCANO_GROUP = "scheduling.k8s.io/group-name"  # annotation
PLUGINS_GROUP = "scheduling.x-k8s.io/pod-group"  # label
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"  # label
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"  # label
KUEUE_COUNT = "kueue.x-k8s.io/pod-group-total-count"  # annotation
KUEUE_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue lifts on admission
UNSCHEDULED = ("Unschedulable", "SchedulingGated")  # PodScheduled=False reasons of a pod waiting for room
MESSAGE_MAX = 2048


def scheduling(spec: dict) -> str:
    return spec.get("scheduling") or "none"


def refusal(spec: dict) -> Optional[str]:
    """Why the spec's scheduling fields cannot run, in one line naming the field; None when they can."""
    kind, queue = scheduling(spec), spec.get("queueName")
    if kind == "kueue" and not queue:
        return "spec.queueName: required with spec.scheduling=kueue (the LocalQueue that admits the job)"
    if queue and kind not in ("kueue", "volcano"):
        return (f"spec.queueName={queue!r}: only spec.scheduling=kueue (a LocalQueue) or volcano (a Queue) "
                f"queues a job, not {kind}")
    return None


def kueue_group(cr: dict) -> str:
    """The Kueue pod group: the job's name and UID, so that a re-created job never joins its predecessor's
    terminating pods (at most 50 + 9 characters: a label value)."""
    return f"{cr['metadata']['name']}-{cr['metadata']['uid'][:8]}"


def pod_group(cr: dict, metadata: dict, priority_class: Optional[str] = None) -> Optional[dict]:
    """The job's PodGroup (`metadata` names it and makes the job its controller), None without one."""
    spec = cr["spec"]
    kind = scheduling(spec)
    if kind not in POD_GROUP_APIS:
        return None
    group, version = POD_GROUP_APIS[kind]
    body: dict = {"minMember": spec["nodes"]}
    if kind == "volcano":  # Volcano queues, orders and preempts whole groups by these
        if spec.get("queueName"):
            body["queue"] = spec["queueName"]
        if priority_class:
            body["priorityClassName"] = priority_class
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": metadata, "spec": body}


def mark_pod(cr: dict, pod: dict) -> None:
    """Adds what the job's gang scheduler reads to one executor pod: its scheduler, its group, Kueue's gate."""
    spec, meta, body = cr["spec"], pod["metadata"], pod["spec"]
    kind = scheduling(spec)
    scheduler = spec.get("schedulerName") or SCHEDULER_NAMES.get(kind)
    if scheduler:
        body["schedulerName"] = scheduler
    if kind == "volcano":
        meta.setdefault("annotations", {})[VOLCANO_GROUP] = cr["metadata"]["name"]
    elif kind == "scheduler-plugins":
        meta["labels"][PLUGINS_GROUP] = cr["metadata"]["name"]
    elif kind == "kueue":
        meta["labels"].update({KUEUE_QUEUE: spec["queueName"], KUEUE_GROUP: kueue_group(cr)})
        meta.setdefault("annotations", {})[KUEUE_COUNT] = str(spec["nodes"] + spec.get("spares", 0))
        # Gated from creation, as Kueue's webhook would gate it: a pod the webhook missed (failurePolicy
        # Ignore, a namespace outside its selector) waits rather than runs past the quota.
        body["schedulingGates"] = [{"name": KUEUE_GATE}]


def unscheduled(pod: Optional[dict]) -> Optional[tuple[str, str]]:
    """(reason, scheduler's message) of a pod the scheduler has not placed and says why; None otherwise."""
    if pod is None or (pod.get("spec") or {}).get("nodeName") or (pod.get("status") or {}).get("phase") != "Pending":
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") in UNSCHEDULED:
            return cond["reason"], cond.get("message") or ""
    return None


def _summary(found: dict[str, tuple[str, str]]) -> str:
    """`pods a, b: message; pod c: other message`: the scheduler often says the same of every pod."""
    by_message: dict[str, list[str]] = {}
    for pod, (reason, message) in sorted(found.items()):
        by_message.setdefault(message or reason, []).append(pod)
    return "; ".join(f"{'pods' if len(pods) > 1 else 'pod'} {', '.join(pods)}: {message}"
                     for message, pods in by_message.items())[:MESSAGE_MAX]


def condition(rec: JobRecord, pods: dict[str, dict], name: str) -> dict:
    """`Unschedulable`: True while pods of nodes in service wait for the scheduler (or Kueue), with its message."""
    found = {f"{name}-{slot.node}": why for slot in rec.nodes
             if slot.role != "evicted" and (why := unscheduled(pods.get(slot.node)))}
    if not found:
        return {"type": "Unschedulable", "status": "False", "reason": "Scheduled", "message": ""}
    gated = all(reason == "SchedulingGated" for reason, _ in found.values())
    return {"type": "Unschedulable", "status": "True", "reason": "SchedulingGated" if gated else "Unschedulable",
            "message": _summary(found)}


def never_formed(pods: dict[str, dict], missing: list[str]) -> Optional[str]:
    """Why nodes that never reported did not: their pods were never placed (the gang never formed); None
    when each of them was placed (then it is the pod's own doing: an image pull, a crash)."""
    unplaced = {pods[n]["metadata"]["name"]: unscheduled(pods[n]) or ("Pending", "not scheduled yet")
                for n in missing if n in pods and not (pods[n].get("spec") or {}).get("nodeName")}
    if not unplaced:
        return None
    return f"Unschedulable: the job's pods were never all scheduled: {_summary(unplaced)}"
