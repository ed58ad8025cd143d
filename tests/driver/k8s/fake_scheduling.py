"""Stand-ins for what a cluster's gang scheduler adds to the stand-in API server (no real scheduler runs here):
the PodGroup CRDs of Volcano and of the scheduler-plugins, registered as their installs register them, and a
gang scheduler that binds a group's pods only when `minMember` of them fit the machines' devices together.
Pods it cannot place stay Pending with PodScheduled=False, reason Unschedulable and a message in
kube-scheduler's words; pods behind a scheduling gate (Kueue's) get reason SchedulingGated, as the
scheduler reports them.
"""
from __future__ import annotations

import time
from typing import Optional

from fake_apiserver import FakeApiServer

GROUP_KEYS = {"scheduling.volcano.sh": ("annotations", "scheduling.k8s.io/group-name"),
              "scheduling.x-k8s.io": ("labels", "scheduling.x-k8s.io/pod-group")}
VERSIONS = {"scheduling.volcano.sh": "v1beta1", "scheduling.x-k8s.io": "v1alpha1"}


def install_pod_groups(api: FakeApiServer) -> None:
    """The two PodGroup CRDs (the fields megascale sets; status left open), as `helm install` creates them."""
    for group, version in VERSIONS.items():
        spec = {"type": "object", "properties": {
            "minMember": {"type": "integer", "minimum": 0}, "queue": {"type": "string"},
            "priorityClassName": {"type": "string"}, "scheduleTimeoutSeconds": {"type": "integer"},
            "minResources": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
        schema = {"type": "object", "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "spec": spec, "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
        api.put({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                 "metadata": {"name": f"podgroups.{group}"},
                 "spec": {"group": group, "scope": "Namespaced",
                          "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup"},
                          "versions": [{"name": version, "served": True, "storage": True,
                                        "subresources": {"status": {}}, "schema": {"openAPIV3Schema": schema}}]}})


def _requests(pod: dict, resource: str) -> int:
    return sum(int(((c.get("resources") or {}).get("limits") or {}).get(resource, 0))
               for c in pod["spec"]["containers"])


def _member_of(pod: dict, group: str, name: str) -> bool:
    where, key = GROUP_KEYS[group]
    return (pod["metadata"].get(where) or {}).get(key) == name


def _set_scheduled(api: FakeApiServer, pod: dict, host: Optional[str], reason: str = "", message: str = "") -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cond = {"type": "PodScheduled", "status": "True" if host else "False", "lastTransitionTime": now,
            **({"reason": reason, "message": message} if not host else {})}

    def change(p: dict) -> None:
        if host:
            p["spec"]["nodeName"] = host
        status = p.setdefault("status", {"phase": "Pending"})
        status["conditions"] = [c for c in status.get("conditions") or [] if c["type"] != "PodScheduled"] + [cond]
    api.update("pods", pod["metadata"]["name"], pod["metadata"]["namespace"], change)


def schedule_gangs(api: FakeApiServer, namespace: str, machines: dict[str, int],
                   resource: str = "nvidia.com/gpu") -> None:
    """One pass of a gang scheduler over the namespace's PodGroups: `machines` maps each machine to its
    devices. A group's unbound pods are bound first-fit when at least minMember of the group then run;
    otherwise none is bound and each says why."""
    pods = api.list("pods", namespace)
    free = dict(machines)
    for pod in pods:
        host = pod["spec"].get("nodeName")
        if host in free and (pod.get("status") or {}).get("phase") in ("Pending", "Running"):
            free[host] -= _requests(pod, resource)
    for group, version in VERSIONS.items():
        for pg in api.list("podgroups", namespace, group=group):
            name, need = pg["metadata"]["name"], pg["spec"]["minMember"]
            members = [p for p in pods if _member_of(p, group, name)]
            bound = [p for p in members if p["spec"].get("nodeName")]
            trial, placed = dict(free), {}
            for pod in (p for p in members if not p["spec"].get("nodeName")):
                host = next((m for m in sorted(trial) if trial[m] >= _requests(pod, resource)), None)
                if host is not None:
                    trial[host] -= _requests(pod, resource)
                    placed[pod["metadata"]["name"]] = host
            fits = len(bound) + len(placed) >= need
            short = sum(1 for m in machines if free[m] < 1)
            for pod in (p for p in members if not p["spec"].get("nodeName")):
                if fits and pod["metadata"]["name"] in placed:
                    _set_scheduled(api, pod, placed[pod["metadata"]["name"]])
                elif not fits:
                    _set_scheduled(api, pod, None, "Unschedulable",
                                   f"0/{len(machines)} nodes are available: {short} Insufficient {resource}. "
                                   f"pod group {name}: {len(bound) + len(placed)} of minMember {need} pods fit")
            if fits:
                free = trial


def report_gated(api: FakeApiServer, namespace: str) -> None:
    """What the scheduler says of pods held by a scheduling gate (Kueue's, until it admits their group)."""
    for pod in api.list("pods", namespace):
        if pod["spec"].get("schedulingGates") and not pod["spec"].get("nodeName"):
            _set_scheduled(api, pod, None, "SchedulingGated", "Scheduling is blocked due to non-empty scheduling gates")
