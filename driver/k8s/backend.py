"""Nodes as pods: the Backend the driver uses on Kubernetes (`driver/local.py` is the other one).

A node is one executor pod, `<job>-<node>`, owned by its TrainingJob, so deleting the job deletes
its pods. Evicting a node records the machine (Kubernetes node) it ran on in the job's Redis; every
pod created afterwards carries a required node anti-affinity to all the job's evicted machines
(`spec.pod`), which holds even after someone uncordons one. Whether the machine is cordoned for
everyone is the operator's call (operator.py: only after a failed self-check, within a budget).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import redis

from .. import log
from ..backend import Backend, NodeInfo, NodeLaunch
from . import spec
from .kube import Kube


class K8sState:
    """A TrainingJob's Kubernetes facts in its Redis, beside its record (one hash slot): the resource's
    uid (tells a re-created job of the same name from the old one), the evicted machines, which node ran
    on each, and the machines cordoned for the job (when)."""

    def __init__(self, client: redis.Redis, job: str):
        prefix = f"megascale:{{{job}}}:k8s:"
        self.r, self.job, self.k_uid, self.k_hosts = client, job, prefix + "uid", prefix + "evicted-hosts"
        self.k_node_hosts, self.k_cordoned = prefix + "evicted-node-hosts", prefix + "cordoned"

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

    def host_of(self, node: str) -> Optional[str]:
        """The machine an evicted node ran on."""
        raw = self.r.hget(self.k_node_hosts, node)
        return raw.decode() if raw else None

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

    def start(self, nodes: list[str]) -> None:
        cr = self.kube.get_job(self.namespace, self.name)  # read each time: the pod template follows the spec
        if cr is None:
            log.warning("TrainingJob %s/%s is gone: not starting %s", self.namespace, self.name, ", ".join(nodes))
            return
        try:  # again here: the spec may have changed since the operator adopted the job
            spec.check_pod_spec(cr["spec"], self.policy, lambda secret: self.kube.secret_labels(self.namespace, secret))
        except spec.SpecError as e:
            log.error("not starting %s: %s", ", ".join(nodes), e)
            return
        avoid = self.state.evicted_hosts()
        for node in nodes:
            created = self.kube.create_pod(self.namespace, spec.pod(cr, node, self.launch, avoid))
            log.info("started node %s (pod %s)%s", node, spec.pod_name(self.name, node),
                     "" if created else ": it existed already")

    def _pods(self) -> dict[str, dict]:
        pods = self.kube.list_pods(self.namespace, f"{spec.JOB_LABEL}={self.name}")
        return {p["metadata"]["labels"][spec.NODE_LABEL]: p for p in pods
                if spec.NODE_LABEL in p["metadata"].get("labels", {})}

    def stop(self, nodes: list[str], grace_s: float = 10.0) -> None:
        for node in nodes:
            self.kube.delete_pod(self.namespace, spec.pod_name(self.name, node), grace_s)
        # Waits for the kubelet to confirm, but not forever: a pod on a dead machine never is.
        deadline = time.monotonic() + grace_s + 5
        while nodes and time.monotonic() < deadline and set(nodes) & set(self._pods()):
            time.sleep(0.5)

    def list(self) -> dict[str, NodeInfo]:
        out = {}
        for node, pod in self._pods().items():
            phase = (pod.get("status") or {}).get("phase", "Pending")
            alive = phase in ("Pending", "Running") and not pod["metadata"].get("deletionTimestamp")
            out[node] = NodeInfo(node, alive, pod["spec"].get("nodeName", ""), f"pod {pod['metadata']['name']}")
        return out

    def evict(self, node: str) -> None:
        pod = self._pods().get(node)
        host = (pod or {}).get("spec", {}).get("nodeName")
        if host:
            self.state.add_evicted_node(node, host)  # first: whatever happens next, later pods avoid the machine
            log.info("evicted node %s: this job's pods avoid %s from now on", node, host)
        # Grace 0 (a forced delete): the pod may sit on a machine that will never confirm its end.
        # A partitioned executor that lives on cannot rejoin: its node id is never used again.
        self.kube.delete_pod(self.namespace, spec.pod_name(self.name, node), grace_s=0)

    def log_files(self, node: str) -> list[Path]:
        return []  # `kubectl logs <job>-<node>`: the executor's log is the pod's
