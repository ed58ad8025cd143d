"""What an executor pod asks of its machine beyond CPU and memory: extended resources (RDMA NICs and other
device-plugin resources, besides spec.deviceResource), the host's network, and a checkpoint volume.

`spec.hostNetwork` is an explicit opt-in that weakens isolation: the pod shares the machine's network
namespace (NCCL then sees the machine's NICs as they are), NetworkPolicies no longer apply to it, and Pod
Security `baseline` refuses it, so the job's namespace must admit privileged pods. The container keeps its
hardening (spec.py): all capabilities dropped but IPC_LOCK with spec.rdma, no privilege escalation.

A checkpoint volume is a PersistentVolumeClaim or an inline CSI volume mounted at
`spec.checkpoint.volume.mountPath` (default CHECKPOINT_MOUNT), where `checkpoint.uri` must point. No CSI
`nodePublishSecretRef`: a job names no Secret but through spec.secrets; storage that needs credentials
comes as a claim, whose StorageClass holds them.

Pure functions of the spec; `refusal` says in one line, naming the field, what the schema cannot.
"""
from __future__ import annotations

import posixpath
from typing import Optional

from kubernetes.utils import parse_quantity

CHECKPOINT_MOUNT = "/var/lib/megascale/checkpoints"
CHECKPOINT_VOLUME = "checkpoints"
# Names a pod's resources may not take as extended resources: Kubernetes' own.
NATIVE_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-")


def checkpoint_volume(spec: dict) -> Optional[dict]:
    return (spec.get("checkpoint") or {}).get("volume")


def mount_path(volume: dict) -> str:
    return posixpath.normpath(volume.get("mountPath") or CHECKPOINT_MOUNT)


def checkpoint_uri(spec: dict) -> Optional[str]:
    """checkpoint.uri with a volume: the spec's (checked by `refusal` to lie on it), else the mount itself."""
    volume = checkpoint_volume(spec)
    if volume is None:
        return None
    return (spec.get("checkpoint") or {}).get("uri") or mount_path(volume)


def apply(spec: dict, body: dict, container: dict) -> None:
    """Adds the spec's extended resources, host network and checkpoint volume to a pod being built."""
    extended = spec.get("extendedResources") or {}
    if extended:  # like devices: limits, which requests default to (extended resources cannot overcommit)
        container["resources"].setdefault("limits", {}).update({k: str(v) for k, v in extended.items()})
    if spec.get("hostNetwork"):
        # ClusterFirstWithHostNet: the job's Service names (n0.<job>.<namespace>.svc) still resolve.
        body.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    volume = checkpoint_volume(spec)
    if volume is not None:
        source = {k: dict(volume[k]) for k in ("persistentVolumeClaim", "csi") if k in volume}
        body["volumes"].append({"name": CHECKPOINT_VOLUME, **source})
        container["volumeMounts"].append({"name": CHECKPOINT_VOLUME, "mountPath": mount_path(volume)})


def refusal(spec: dict, taken_paths: dict[str, str]) -> Optional[str]:
    """Why these fields cannot run, in one line naming the field; None when they can. `taken_paths`: mount
    path -> what the pod mounts there already."""
    device = spec.get("deviceResource", "nvidia.com/gpu")
    for name in spec.get("extendedResources") or {}:
        field = f"spec.extendedResources[{name!r}]"
        domain = name.partition("/")[0]
        if "/" not in name or name.startswith(NATIVE_RESOURCES):
            return f"{field}: not an extended resource (domain/name, e.g. rdma/hca); cpu, memory: spec.resources"
        if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
            return f"{field}: the kubernetes.io domain is Kubernetes' own, not a device plugin's"
        if name == device:
            return f"{field}: already requested: spec.devicesPerNode of spec.deviceResource={device!r}"
    memory = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
    shm = spec.get("shmSize")
    if memory is not None and shm is not None and parse_quantity(shm) > parse_quantity(memory):
        return (f"spec.shmSize={shm}: more than spec.resources.limits.memory={memory}, which the memory-backed "
                f"/dev/shm counts against")
    volume = checkpoint_volume(spec)
    if volume is None:
        return None
    mount = mount_path(volume)
    if not posixpath.isabs(mount) or mount == "/":
        return f"spec.checkpoint.volume.mountPath={mount!r}: an absolute path below /"
    for path, what in taken_paths.items():
        if mount == path or mount.startswith(path + "/") or path.startswith(mount + "/"):
            return f"spec.checkpoint.volume.mountPath={mount!r}: overlaps {path}, the pod's {what}"
    uri = (spec.get("checkpoint") or {}).get("uri")
    local = posixpath.normpath(uri.removeprefix("file://")) if uri else mount
    if local != mount and not local.startswith(mount + "/"):
        return (f"spec.checkpoint.uri={uri!r}: not on spec.checkpoint.volume, mounted at {mount}: give a path "
                f"under it, or leave the uri out to checkpoint at {mount}")
    return None
