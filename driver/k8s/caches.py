"""What the operator keeps of the objects it watches, and how a job's driver reads its pods from there.

The API server's load must not grow with the jobs' drivers: each driver looks at its pods about once a
second (driver/recovery/detection.py), which as a list per driver would be N lists a second. The
operator's pod informer (one list, then one watch) already holds every pod; each pass it publishes a
job's pods, trimmed to what the driver reads, in the job's Redis (`PodCache.publish`, only when one of
them changed), and the driver reads them there (`PodCache.read`, a full read only when they changed).

Machines are cached trimmed to the fields the operator reads (name, labels, unschedulable, the Ready
condition): a Node object carries its images, volumes and capacities besides, tens of KB each. That is
a field-trimmed cache rather than PartialObjectMetadata, which would drop the Ready condition the
eviction of nodes on NotReady machines needs.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import redis

# The largest parts of a pod the driver never reads: the anti-affinity grows with the job's evicted machines.
SPEC_DROPPED = ("affinity", "tolerations")
META_DROPPED = ("managedFields", "annotations")


def trim_pod(pod: dict) -> dict:
    """A pod as the driver reads it (backend.py, failures.py): metadata, spec (where it runs, its containers'
    limits and volumes), status."""
    meta = {k: v for k, v in pod["metadata"].items() if k not in META_DROPPED}
    spec = {k: v for k, v in (pod.get("spec") or {}).items() if k not in SPEC_DROPPED}
    return {"metadata": meta, "spec": spec, "status": pod.get("status") or {}}


def trim_machine(machine: dict) -> dict:
    """A Kubernetes node as the operator reads it (health.py): name, labels, unschedulable, Ready."""
    meta, status = machine.get("metadata") or {}, machine.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels") if k in meta},
            "spec": {k: v for k, v in (machine.get("spec") or {}).items() if k == "unschedulable"},
            "status": {"conditions": [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]}}


class PodCache:
    """A job's pods in its Redis (one hash slot with its record): node -> trimmed pod, and a version that
    changes whenever any of them does."""

    def __init__(self, client: redis.Redis, job: str):
        prefix = f"megascale:{{{job}}}:k8s:"
        self.r, self.k_pods, self.k_version = client, prefix + "pods", prefix + "pods-version"
        self._published: Optional[bytes] = None  # the version `publish` wrote last
        self._read: tuple[Optional[bytes], list[dict]] = (None, [])  # what `read` returned last, and its version

    @staticmethod
    def version(pods: dict[str, dict]) -> str:
        """Changes with any pod's resourceVersion, or the set of pods."""
        stamp = sorted((node, p["metadata"].get("uid", ""), p["metadata"].get("resourceVersion", ""))
                       for node, p in pods.items())
        return hashlib.sha1(json.dumps(stamp).encode()).hexdigest()[:16]

    def publish(self, pods: dict[str, dict]) -> bool:
        """The operator: the job's pods by node, from its informer; written when they changed (True)."""
        version = self.version(pods).encode()
        if version == self._published:
            return False
        with self.r.pipeline() as pipe:  # MULTI: a reader sees the old pods and version, or the new ones
            pipe.delete(self.k_pods)
            if pods:
                pipe.hset(self.k_pods, mapping={node: json.dumps(trim_pod(p)) for node, p in pods.items()})
            pipe.set(self.k_version, version)
            pipe.execute()
        self._published = version
        return True

    def read(self) -> Optional[list[dict]]:
        """The driver: the job's pods as the operator last saw them; None if it never published any."""
        version = self.r.get(self.k_version)
        if version is None:
            return None
        if version != self._read[0]:
            with self.r.pipeline() as pipe:
                version, raw = pipe.get(self.k_version).hgetall(self.k_pods).execute()
            self._read = (version, [json.loads(v) for v in raw.values()])
        return list(self._read[1])
