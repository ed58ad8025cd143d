"""Nodes as pods: the Backend the driver uses on Kubernetes (`driver/local.py` is the other one).

A node is one executor pod, `<job>-<node>`, owned by its TrainingJob (by UID: ownership.py), so deleting
the job deletes its pods. Evicting a node records the machine (Kubernetes node) it ran on in the job's
Redis when the pod's evidence blames it (failures.py: not for a preemption, a drain, an OOM kill or a pod
that never started); every pod created afterwards carries a required node anti-affinity to all the job's
evicted machines (`spec.pod`), which holds even after someone uncordons one. Whether the machine is
cordoned for everyone is the operator's call (operator.py: only after a failed self-check, within a budget).

With a gang scheduler (spec.scheduling, gang.py) the job's PodGroup is created before its pods; a start
timeout whose pods were never all placed is reported as Unschedulable (`why_not_started`), not as a node's
fault: an unplaced pod never blames a machine.

No API error ends the driver: transient ones are retried by the client (api_retry.py); a pod that still
could not be created, or was refused (403 by a quota or Pod Security, 422), is recorded for the operator's
FailedCreatePod condition, reported as an Event on the TrainingJob, and tried again every RESEND_S.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import redis
from kubernetes.client.exceptions import ApiException

from .. import log
from ..backend import Backend, NodeInfo, NodeLaunch
from . import api_retry, gang, spec
from .failures import classify, never_started
from .kube import REQUEST_TIMEOUT_S, Kube
from .ownership import NotOwned, controller_uid, owned_by

RESEND_S = 10.0  # a pod that could not be created is tried again this often (quota freed, old pod gone)


class K8sState:
    """A TrainingJob's Kubernetes facts in its Redis, beside its record (one hash slot): the resource's
    uid (tells a re-created job of the same name from the old one), the evicted machines, which node ran
    on each, and the machines cordoned for the job (when)."""

    def __init__(self, client: redis.Redis, job: str):
        prefix = f"megascale:{{{job}}}:k8s:"
        self.r, self.job, self.k_uid, self.k_hosts = client, job, prefix + "uid", prefix + "evicted-hosts"
        self.k_node_hosts, self.k_cordoned = prefix + "evicted-node-hosts", prefix + "cordoned"
        self.k_excused, self.k_refused = prefix + "excused", prefix + "refused-pods"

    def uid(self) -> Optional[str]:
        raw = self.r.get(self.k_uid)
        return raw.decode() if raw else None

    def set_uid(self, uid: str) -> None:
        self.r.set(self.k_uid, uid)

    def evicted_hosts(self) -> list[str]:
        return sorted(m.decode() for m in self.r.smembers(self.k_hosts))

    def add_evicted_hosts(self, *hosts: str) -> None:
        if hosts:
            self.r.sadd(self.k_hosts, *hosts)

    def add_evicted_node(self, node: str, host: str) -> None:
        self.r.hset(self.k_node_hosts, node, host)
        self.add_evicted_hosts(host)

    def forget_nodes(self, nodes: list[str]) -> None:
        """Drops the machine each of these evicted nodes ran on and the operator's excuse for it; the machines
        themselves stay in `evicted_hosts`."""
        if nodes:
            self.r.hdel(self.k_node_hosts, *nodes)
            self.r.hdel(self.k_excused, *nodes)

    def host_of(self, node: str) -> Optional[str]:
        """The machine an evicted node ran on."""
        raw = self.r.hget(self.k_node_hosts, node)
        return raw.decode() if raw else None

    def excuse(self, node: str, why: str) -> None:
        """The operator found the node's end was not its machine's doing (a preemption, say): evicting it
        later does not record the machine, even once its pod is gone."""
        self.r.hset(self.k_excused, node, why)

    def excused(self, node: str) -> bool:
        return bool(self.r.hexists(self.k_excused, node))

    def refused(self) -> dict[str, str]:
        """Node -> why its pod could not be created (the API's message), until it is."""
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.k_refused).items()}

    def set_refused(self, node: str, why: Optional[str]) -> None:
        if why is None:
            self.r.hdel(self.k_refused, node)
        else:
            self.r.hset(self.k_refused, node, why)

    def cordoned(self) -> dict[str, float]:
        """Machine -> when it was cordoned for this job (epoch seconds)."""
        return {k.decode(): float(v) for k, v in self.r.hgetall(self.k_cordoned).items()}

    def add_cordoned(self, host: str, when: float) -> None:
        self.r.hset(self.k_cordoned, host, when)

    def _keys(self) -> list[bytes]:
        return list(self.r.scan_iter(match=f"megascale:{{{self.job}}}:*", count=1000))

    def expire(self, seconds: float) -> None:
        for key in self._keys():
            self.r.expire(key, int(seconds))

    def wipe(self) -> int:
        """Deletes every key of the job (record, commands, acks, offsets, these): a fresh start."""
        keys = self._keys()
        return self.r.delete(*keys) if keys else 0


class KubernetesBackend(Backend):
    def __init__(self, kube: Kube, namespace: str, name: str, launch: NodeLaunch, client: redis.Redis,
                 policy: spec.PodPolicy):
        self.kube, self.namespace, self.name, self.launch, self.policy = kube, namespace, name, launch, policy
        self.state = K8sState(client, launch.job)
        self.uid = self.state.uid() or ""  # the operator records it before it starts this driver
        self.unsent: dict[str, float] = {}  # node -> when to try creating its pod again
        self._listed: dict[str, dict] = {}  # the last listing, for when the API server cannot be reached

    def start(self, nodes: list[str]) -> None:
        try:
            cr = self.kube.get_job(self.namespace, self.name)  # read each time: the pod template follows the spec
        except api_retry.API_ERRORS as e:
            self._unsent(nodes, f"cannot read TrainingJob {self.namespace}/{self.name}: {api_retry.message(e)}")
            return
        if cr is None or (self.uid and cr["metadata"]["uid"] != self.uid):
            log.warning("TrainingJob %s/%s is gone: not starting %s", self.namespace, self.name, ", ".join(nodes))
            return
        self.uid = self.uid or cr["metadata"]["uid"]
        try:  # again here: the spec may have changed since the operator adopted the job
            spec.check_pod_spec(cr["spec"], self.policy, lambda secret: self.kube.secret_labels(self.namespace, secret))
        except spec.SpecError as e:
            log.error("not starting %s: %s", ", ".join(nodes), e)
            return
        except api_retry.API_ERRORS as e:
            self._unsent(nodes, f"cannot check the pod spec: {api_retry.message(e)}")
            return
        if not self._ensure_pod_group(cr, nodes):
            return
        avoid = self.state.evicted_hosts()
        for node in nodes:
            self._create(cr, node, avoid)

    def _ensure_pod_group(self, cr: dict, nodes: list[str]) -> bool:
        """The job's PodGroup (gang.py) before its pods, which its scheduler holds until the group exists."""
        body = spec.pod_group(cr, self.policy)
        if body is None:
            return True
        try:
            self._create_pod_group(body)
        except NotOwned as e:
            self._unsent(nodes, str(e))
            return False
        except api_retry.API_ERRORS as e:
            self._failed(cr, nodes, f"PodGroup {self.name}: {api_retry.message(e)}", e)
            return False
        return True

    def _create_pod_group(self, body: dict) -> None:
        """Created, or found already as this job's (a restarted driver); NotOwned when another owner's."""
        args = (*body["apiVersion"].split("/"), self.namespace, gang.POD_GROUPS)
        try:
            self.kube.custom.create_namespaced_custom_object(*args, body, _preload_content=False,
                                                             _request_timeout=REQUEST_TIMEOUT_S)
            log.info("created PodGroup %s (minMember %d)", self.name, body["spec"]["minMember"])
            return
        except ApiException as e:
            if e.status != 409:
                raise
        existing = json.loads(self.kube.custom.get_namespaced_custom_object(
            *args, self.name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S).data)
        if not owned_by(existing, self.uid):
            raise NotOwned(f"PodGroup {self.namespace}/{self.name} exists with owner UID {controller_uid(existing)}, "
                           f"not {self.uid} (a deleted job's, waiting for the garbage collector?)")

    def _create(self, cr: dict, node: str, avoid: list[str]) -> None:
        name = spec.pod_name(self.name, node)
        try:
            created = self.kube.create_pod(self.namespace, spec.pod(cr, node, self.launch, avoid, self.policy))
        except NotOwned as e:
            self._unsent([node], str(e))
            return
        except api_retry.API_ERRORS as e:
            self._failed(cr, [node], f"pod {name}: {api_retry.message(e)}", e)
            return
        self.unsent.pop(node, None)
        self.state.set_refused(node, None)
        log.info("started node %s (pod %s)%s", node, name, "" if created else ": it existed already")

    def _failed(self, cr: dict, nodes: list[str], why: str, error: BaseException) -> None:
        """A create that failed: tried again later; a refusal is recorded for FailedCreatePod and told once."""
        self._unsent(nodes, why)
        if not api_retry.refused(error):
            return
        refused = self.state.refused()
        for node in nodes:
            self.state.set_refused(node, why)
        if any(refused.get(node) != why for node in nodes):
            self.kube.create_event(cr, "Warning", "FailedCreatePod", why)

    def _unsent(self, nodes: list[str], why: str) -> None:
        log.warning("could not start %s (trying again in %.0f s): %s", ", ".join(nodes), RESEND_S, why)
        for node in nodes:
            self.unsent[node] = time.monotonic() + RESEND_S

    def _resend(self) -> None:
        """Pods that could not be created, tried again when due (from `list`, which the driver calls often)."""
        due = [n for n, t in self.unsent.items() if time.monotonic() >= t]
        if due:
            for node in due:
                del self.unsent[node]
            self.start(due)

    def _pods(self) -> dict[str, dict]:
        """The job's pods by node: those whose controller is this TrainingJob (by UID), not a predecessor's."""
        pods = self.kube.job_pods(self.namespace, self.name)  # the operator's cache (caches.py)
        self._listed = {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in pods
                        if spec.NODE_LABEL in p["metadata"].get("labels", {})
                        and (not self.uid or owned_by(p, self.uid))}
        return self._listed

    def stop(self, nodes: list[str], grace_s: float = 10.0) -> None:
        for node in nodes:
            self.unsent.pop(node, None)
        try:
            pods = self._pods()
            for node in nodes:
                if node in pods:
                    self.kube.delete_pod(self.namespace, spec.pod_name(self.name, node), grace_s,
                                         uid=pods[node]["metadata"]["uid"])
            # Waits for the kubelet to confirm, but not forever: a pod on a dead machine never is.
            deadline = time.monotonic() + grace_s + 5
            while nodes and time.monotonic() < deadline and set(nodes) & set(self._pods()):
                time.sleep(0.5)
        except api_retry.API_ERRORS as e:  # the pods are the job's: they go with it at the latest
            log.warning("could not stop %s: %s", ", ".join(nodes), api_retry.message(e))

    def list(self) -> dict[str, NodeInfo]:
        self._resend()
        try:
            pods = self._pods()
        except api_retry.API_ERRORS as e:  # the last listing: the driver's heartbeats still catch dead nodes
            log.warning("cannot list the job's pods (%s); using the last listing", api_retry.message(e))
            pods = self._listed
        out = {}
        for node, pod in pods.items():
            phase = (pod.get("status") or {}).get("phase", "Pending")
            alive = phase in ("Pending", "Running") and not pod["metadata"].get("deletionTimestamp")
            out[node] = NodeInfo(node, alive, pod["spec"].get("nodeName", ""), f"pod {pod['metadata']['name']}")
        return out

    def evict(self, node: str) -> None:
        self.unsent.pop(node, None)
        try:
            pod = self._pods().get(node)
        except api_retry.API_ERRORS as e:
            log.warning("cannot read node %s's pod (%s): evicting it by name", node, api_retry.message(e))
            pod = self._listed.get(node)
        host = (pod or {}).get("spec", {}).get("nodeName")
        if host and self._blames(node, pod):
            self.state.add_evicted_node(node, host)  # first: whatever happens next, later pods avoid the machine
            log.info("evicted node %s: this job's pods avoid %s from now on", node, host)
        # Grace 0 (a forced delete): the pod may sit on a machine that will never confirm its end.
        # A partitioned executor that lives on cannot rejoin: its node id is never used again.
        try:
            self.kube.delete_pod(self.namespace, spec.pod_name(self.name, node), grace_s=0,
                                 uid=(pod or {}).get("metadata", {}).get("uid"))
        except api_retry.API_ERRORS as e:  # its pod goes with the job at the latest; the node id is never reused
            log.warning("could not delete node %s's pod: %s", node, api_retry.message(e))

    def forget_evicted(self, nodes: list[str]) -> None:
        self.state.forget_nodes(nodes)

    def _blames(self, node: str, pod: dict) -> bool:
        """Whether the node's end may be its machine's fault, from the pod itself and the operator's verdict."""
        if self.state.excused(node) or never_started(pod):
            return False
        found = classify(pod)
        return found is None or found.blame  # a running pod evicted (silent, straggling): the machine is suspect

    def why_not_started(self, nodes: list[str]) -> Optional[str]:
        """Unschedulable, with the scheduler's message, when these nodes' pods were never all placed."""
        try:
            pods = self._pods()
        except api_retry.API_ERRORS:
            pods = self._listed
        return gang.never_formed(pods, nodes)

    def log_files(self, node: str) -> list[Path]:
        return []  # `kubectl logs <job>-<node>`: the executor's log is the pod's
