"""Why an executor pod ended, from the pod's own evidence, and what that says about its machine.

Kubernetes ends pods for reasons that have nothing to do with the machine: the scheduler preempts a
lower-priority pod, a drain evicts it, the kubelet evicts under memory pressure, the job outgrows its own
memory limit, an image cannot be pulled. Each class decides two things:
- `blame`: the job keeps its later pods off the machine (a node anti-affinity for this job only). Never a
  cordon by itself: a failed self-check or a hardware error in a rank's log cordons a machine
  (health.cordons), and so do crashes (`Crashed`) of pods of different jobs there (crashes.py).
- `replace`: the operator asks the driver to replace the node now, an eviction that is no restart. The
  others are left to the driver, which sees the pod end and counts a restart: a job that kills its own
  pods (OOM, a crash) runs out of restarts, not of machines.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

# The DisruptionTarget condition's reasons (Kubernetes 1.26+): the cluster ended the pod.
DISRUPTIONS = {
    "PreemptionByScheduler": "was preempted by the scheduler for a higher-priority pod",
    "EvictionByEvictionAPI": "was evicted through the Eviction API (a drain, say)",
    "TerminationByKubelet": "was terminated by the kubelet (node pressure or a node shutdown)",
    "DeletionByTaintManager": "was deleted for a NoExecute taint on its machine",
    "DeletionByPodGC": "was deleted by the pod garbage collector (its machine is gone)",
}
# Waiting reasons of a container that never ran: the image or the pod's own config, not the machine.
NEVER_STARTED = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "CreateContainerConfigError", "CreateContainerError"}


@dataclass(frozen=True)
class Failure:
    kind: str  # a DisruptionTarget reason, OOMKilled, an image-pull reason, Crashed, Exited, Deleted, ...
    message: str
    blame: bool  # the job avoids the machine from now on
    replace: bool  # the operator requests the node's eviction (no restart counted)


def _containers(pod: dict) -> list[dict]:
    return (pod.get("status") or {}).get("containerStatuses") or []


def _disruption(pod: dict) -> Optional[dict]:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return cond
    return None


def never_started(pod: dict) -> bool:
    """No container of the pod ever ran (still pulling, or refused to start)."""
    return not any({"running", "terminated"} & set(cs.get("state") or {}) or "terminated" in (cs.get("lastState") or {})
                   or cs.get("restartCount") for cs in _containers(pod))


def memory_limit(pod: dict) -> str:
    """The pod's memory limit and /dev/shm size, in the words an OOM message needs."""
    limits = [((c.get("resources") or {}).get("limits") or {}).get("memory")
              for c in (pod.get("spec") or {}).get("containers") or []]
    shm = next((v["emptyDir"].get("sizeLimit") for v in (pod.get("spec") or {}).get("volumes") or []
                if v.get("name") == "shm" and v.get("emptyDir")), None)
    limit = f"its memory limit {limits[0]}" if limits and limits[0] else "no memory limit (the machine ran out)"
    return limit + (f", which the memory-backed /dev/shm (up to {shm}) counts against" if shm else "")


def _exit(code: Optional[int]) -> str:
    if code is not None and code > 128:
        try:
            return f"exit code {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def classify(pod: dict) -> Optional[Failure]:
    """What the pod says about its end; None while it runs (or waits) without trouble."""
    name, status = pod["metadata"]["name"], pod.get("status") or {}
    disruption = _disruption(pod)
    if disruption is not None:
        why = DISRUPTIONS.get(disruption.get("reason"), f"was disrupted ({disruption.get('reason')})")
        detail = f": {disruption['message']}" if disruption.get("message") else ""
        return Failure(disruption.get("reason") or "DisruptionTarget", f"pod {name} {why}{detail}", False, True)
    if status.get("reason") == "Evicted":  # the kubelet's node-pressure eviction, before DisruptionTarget
        return Failure("Evicted", f"pod {name} was evicted by the kubelet: {status.get('message', '')}".rstrip(": "),
                       False, True)
    for cs in _containers(pod):
        ended = (cs.get("state") or {}).get("terminated") or {}
        if ended.get("reason") == "OOMKilled":
            who = f"container {cs['name']}" if cs.get("name") else "its container"
            return Failure("OOMKilled", f"pod {name}: {who} was killed for using more memory than "
                           f"{memory_limit(pod)}: raise spec.resources.limits.memory or lower spec.shmSize",
                           False, False)
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in NEVER_STARTED and never_started(pod):
            return Failure(waiting["reason"], f"pod {name} never started: {waiting['reason']}: "
                                              f"{waiting.get('message', '')}".rstrip(": "), False, False)
    if pod["metadata"].get("deletionTimestamp"):
        return Failure("Deleted", f"pod {name} is being deleted (not by its driver)", False, True)
    if status.get("phase") not in ("Failed", "Succeeded"):
        return None
    ended = next(((cs.get("state") or {}).get("terminated") for cs in _containers(pod)
                  if (cs.get("state") or {}).get("terminated")), None)
    if ended is None:  # refused by the kubelet before any container ran (OutOfcpu, NodeAffinity, ...)
        return Failure(status.get("reason") or "Failed", f"pod {name} failed: {status.get('reason', 'no reason')} "
                       f"{status.get('message', '')}".strip(), False, True)
    if ended.get("exitCode") == 0:
        return Failure("Exited", f"pod {name}: its executor exited (code 0)", False, False)
    why = f", {ended['reason']}" if ended.get("reason") not in (None, "", "Error") else ""
    # A crash may be the image or the machine (SIGBUS, a GPU error): the job avoids the machine, and the
    # driver's self-check decides whether it is bad for everyone.
    return Failure("Crashed", f"pod {name} failed: {_exit(ended.get('exitCode'))}{why}", True, False)
