"""The TrainingJob CustomResourceDefinition, generated here so the inline job config's schema follows
`megascale/config.py` (`python -m megascale.driver.k8s.crd > deploy/crd.yaml`; a test keeps them equal).

The schema rejects bad specs at admission: types, ranges, enums, required fields, exactly one
config source, unknown inline config fields (kubectl's default strict field validation), CEL rules
for what one field cannot say alone (the world size, TP groups inside a node), and CEL transition rules
(`self == oldSelf`) that make every spec field immutable but the few the operator applies live.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from megascale.driver.state import JobState

from megascale.checkpoint.filesystems import NAME as FILESYSTEM_NAME
from megascale.common import typed
from megascale.config import JobConfig

from .gang import SCHEDULING
from .hardware import CHECKPOINT_MOUNT
from .spec import (
    ALLOW_JOBS_LABEL,
    DEVICE_RESOURCE,
    GROUP,
    KIND,
    NOT_READY_GRACE_S,
    PLURAL,
    POLICY,
    SHM_SIZE,
    SPEC_OWNED,
    VERSION,
)

NAME = f"{PLURAL}.{GROUP}"
MAX_NAME = 50  # leaves room for "-config" and "-n123" within the 63 characters of names and labels

# Inline config fields the spec owns (spec.py: SPEC_OWNED): kept out so a job says each thing once.
SPEC_OWNED_CONFIG = {"name", "cluster", "services", "train.run_dir",
                     *(path for path in SPEC_OWNED if path.split(".")[0] not in ("cluster", "services"))}

QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}


def _obj(properties: dict, required: tuple = (), description: str = "", **extra: Any) -> dict:
    schema: dict = {"type": "object"}
    if description:
        schema["description"] = description
    schema["properties"] = properties
    if required:
        schema["required"] = list(required)
    return {**schema, **extra}


def _int(minimum: int, maximum: int, description: str = "", **extra: Any) -> dict:
    return {"type": "integer", **({"description": description} if description else {}), "minimum": minimum,
            "maximum": maximum, **extra}


def _num(minimum: float, maximum: float, description: str = "", **extra: Any) -> dict:
    return {"type": "number", **({"description": description} if description else {}), "minimum": minimum,
            "maximum": maximum, **extra}


def _str(description: str = "", **extra: Any) -> dict:
    return {"type": "string", **({"description": description} if description else {}), **extra}


# -- the inline job config, from the dataclasses -----------------------------------------------------

def config_schema() -> dict:
    """What the reader of job configs accepts (`typed.schema`), less the fields the spec owns."""
    schema = _structural(typed.schema(JobConfig))
    for path in sorted(SPEC_OWNED_CONFIG):
        *sections, name = path.split(".")
        node = schema
        for section in sections:
            node = node["properties"][section]
        del node["properties"][name]  # a KeyError here: SPEC_OWNED names a field the config no longer has
    # A file system by registered name only: admission refuses module paths ("os:system") outright.
    schema["properties"]["checkpoint"]["properties"]["filesystem"].update(
        pattern=FILESYSTEM_NAME.pattern, description="a registered file system: local, hdfs, s3, gcs or an installed "
                                                     "plugin (entry points megascale.filesystems)")
    return schema


# Kubernetes takes `anyOf` of types only as int-or-string: text values (comm.env) that the reader also
# takes as numbers or booleans are admitted as strings and integers.
_TEXT = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


def _structural(node: Any) -> Any:
    if node == _TEXT:
        return copy.deepcopy(_INT_OR_STRING)  # a copy per field: a shared one would dump as a YAML alias
    return {key: _structural(value) for key, value in node.items()} if isinstance(node, dict) else node


# -- the resource ------------------------------------------------------------------------------

_DNS_SUBDOMAIN = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def checkpoint_volume_schema() -> dict:
    """A claim or an inline CSI volume for checkpoints (hardware.py); no CSI Secret: jobs name Secrets only
    through spec.secrets."""
    csi = _obj({"driver": _str(minLength=1, maxLength=63), "fsType": _str(), "readOnly": {"type": "boolean"},
                "volumeAttributes": {"type": "object", "additionalProperties": {"type": "string"}}},
               required=("driver",))
    claim = _obj({"claimName": _str(minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN),
                  "readOnly": {"type": "boolean"}}, required=("claimName",))
    return _obj({"mountPath": _str("where the pods mount it; checkpoint.uri is a path under it (default: it)",
                                   default=CHECKPOINT_MOUNT, pattern="^/"),
                 "persistentVolumeClaim": claim, "csi": csi},
                description="a volume every pod mounts for checkpoints: exactly one of persistentVolumeClaim or csi",
                oneOf=[{"required": ["persistentVolumeClaim"]}, {"required": ["csi"]}])


def spec_schema() -> dict:
    policy_fields = {
        "heartbeatSeconds": ("executor heartbeat period", 0.1, 300.0),
        "deadAfterSeconds": ("silence after which a node is dead (at least twice the heartbeat)", 0.2, 3600.0),
        "startTimeoutSeconds": ("for all nodes to report in", 1.0, 86400.0),
        "commandTimeoutSeconds": ("for a node to acknowledge a command", 1.0, 3600.0),
    }
    policy = {name: _num(lo, hi, what, default=POLICY[name][1]) for name, (what, lo, hi) in policy_fields.items()}
    policy["maxRestarts"] = _int(0, 1000, "automatic rank restarts after a rank fails, before the job fails",
                                 default=POLICY["maxRestarts"][1])
    toleration = _obj({"key": _str(), "operator": _str(enum=["Exists", "Equal"]), "value": _str(),
                       "effect": _str(enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                       "tolerationSeconds": {"type": "integer"}})
    # No secretKeyRef / configMapKeyRef: a job author who cannot read the namespace's Secrets must not mount
    # them through the operator (spec.secrets names the ones labelled for jobs).
    field_ref = _obj({"fieldPath": _str(minLength=1), "apiVersion": _str()}, required=("fieldPath",))
    env = _obj({"name": _str(minLength=1), "value": _str(),
                "valueFrom": _obj({"fieldRef": field_ref}, required=("fieldRef",),
                                  description="fieldRef only: secrets come through spec.secrets")},
               required=("name",))
    secret = _obj({"name": _str(maxLength=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")}, required=("name",))
    return _obj({
        "image": _str("container image with megascale installed; each pod runs `python -m megascale.executor`",
                      minLength=1),
        "imagePullPolicy": _str(enum=["Always", "IfNotPresent", "Never"]),
        "nodes": _int(1, 100000, "active nodes: one executor pod each"),
        "devicesPerNode": _int(1, 64, "ranks per node, one per device"),
        "deviceResource": _str("extended resource each pod requests devicesPerNode of; \"\" requests none "
                               "(CPU ranks)", default=DEVICE_RESOURCE),
        "parallelism": _obj({k: _int(1, 100000, default=1) for k in ("tp", "pp", "dp")},
                            description="tp * pp * dp must equal nodes * devicesPerNode"),
        "spares": _int(0, 1000, "hot spare nodes (running executors without ranks) that replace evicted ones",
                       default=0),
        "config": _obj({
            "inline": {**config_schema(), "description": "the job config (megascale YAML) without the fields "
                                                         "this spec owns"},
            "configMapRef": _obj({"name": _str(minLength=1), "key": _str(default="config.yaml")}, required=("name",),
                                 description="a ConfigMap key holding a job YAML; this spec's fields override it"),
        }, description="what to train: exactly one of inline or configMapRef",
            oneOf=[{"required": ["inline"]}, {"required": ["configMapRef"]}]),
        "checkpoint": _obj({"uri": _str("file://, hdfs:// or s3:// location of the checkpoints", minLength=1),
                            "every": _int(0, 10**9, "steps between checkpoints; 0: none"),
                            "keep": _int(1, 1000, "newest checkpoints kept"),
                            "volume": checkpoint_volume_schema()}),
        "services": _obj({"redis": _str("redis://host:port[/db]; default: the operator's", pattern="^rediss?://"),
                          "kafka": _str("Kafka bootstrap servers host:port[,host:port]; default: the operator's",
                                        minLength=1)}),
        "policy": _obj(policy, description="heartbeats, failure detection and restarts", default={}),
        "paused": {"type": "boolean", "description": "true stops the ranks and holds the job; false resumes it",
                   "default": False},
        "resources": _obj({"requests": {"type": "object", "additionalProperties": QUANTITY},
                           "limits": {"type": "object", "additionalProperties": QUANTITY}},
                          description="each executor pod's resources, besides the devices"),
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": toleration},
        "env": {"type": "array", "items": env, "description": "extra environment of each executor and its ranks"},
        "secrets": {"type": "array", "items": secret, "maxItems": 32, "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "description": f"Secrets of the namespace mounted read-only at /var/run/megascale/secrets/<name> "
                                   f"in every pod; only those labelled {ALLOW_JOBS_LABEL}=\"true\""},
        "serviceAccountName": _str("the pods' service account; only those the operator's configuration lists "
                                   "(`megascale kube operator --service-account`)"),
        "rdma": {"type": "boolean", "default": False,
                 "description": "the pods get the IPC_LOCK capability (RDMA memory registration); no other is added"},
        "runAsNonRoot": {"type": "boolean", "default": False,
                         "description": "the image runs as a non-root user: the kubelet refuses to start it as root"},
        "shmSize": {**QUANTITY, "default": SHM_SIZE,
                    "description": "size limit of each pod's /dev/shm (memory, counted against the pod's limit)"},
        "cordonBudget": _int(0, 1000, "machines the operator may cordon for this job per hour, each only on "
                                      "evidence of a bad machine (a failed self-check, a hardware error in a "
                                      "rank's log, pods of different jobs crashing there)", default=1),
        "priorityClassName": _str("the executor pods' PriorityClass; default: the operator's (--priority-class)",
                                  maxLength=253),
        "scheduling": _str("gang scheduling: none (pod by pod), volcano or scheduler-plugins (a PodGroup of "
                           "minMember nodes), kueue (one Kueue pod group, admitted whole from spec.queueName)",
                           enum=list(SCHEDULING), default="none"),
        "queueName": _str("kueue: the LocalQueue (required); volcano: the Queue", maxLength=63,
                          pattern=_DNS_SUBDOMAIN),
        "schedulerName": _str("the pods' scheduler; default: volcano, scheduler-plugins-scheduler, else the "
                              "cluster's", maxLength=253, pattern=_DNS_SUBDOMAIN),
        "hostNetwork": {"type": "boolean", "default": False,
                        "description": "the pods share their machine's network (NCCL on the host's NICs): no "
                                       "NetworkPolicy applies to them, and their namespace must admit privileged "
                                       "pods"},
        "extendedResources": {"type": "object", "additionalProperties": _int(1, 1024), "maxProperties": 16,
                              "description": "device-plugin resources each pod requests besides deviceResource "
                                             "(RDMA NICs: rdma/hca_shared_devices_a: 1)"},
        "nodeNotReadyGraceSeconds": _int(0, 3600, "a machine NotReady this long fails the job's nodes on it",
                                         default=NOT_READY_GRACE_S),
    }, required=("image", "nodes", "devicesPerNode", "parallelism", "config"), **{"x-kubernetes-validations": [
        {"rule": "self.nodes * self.devicesPerNode == self.parallelism.tp * self.parallelism.pp * self.parallelism.dp",
         "message": "spec.nodes * spec.devicesPerNode must equal spec.parallelism.tp * pp * dp (the world size)"},
        {"rule": "self.devicesPerNode % self.parallelism.tp == 0",
         "message": "spec.devicesPerNode must be a multiple of spec.parallelism.tp (a TP group stays inside a node)"},
    ]})


# What the operator reads from the spec on every pass. Every other field is frozen at submission: the job's
# record in Redis holds the config resolved from it, and the driver creates each pod from the spec as it is
# then, so an edit would half apply (spares the driver never starts, pods of two images).
LIVE_FIELDS = ("paused", "cordonBudget", "nodeNotReadyGraceSeconds")


def freeze(spec: dict) -> dict:
    """Transition rules on the spec: a frozen field may not change, nor (one without a default) come or go."""
    spec = copy.deepcopy(spec)
    for name, field in spec["properties"].items():
        if name in LIVE_FIELDS:
            continue
        field.setdefault("x-kubernetes-validations", []).append({
            "rule": "self == oldSelf", "message": f"spec.{name} cannot change once the job is submitted "
                                                  f"(delete and re-create the TrainingJob to change it)"})
        if name not in spec.get("required", []) and "default" not in field:
            spec.setdefault("x-kubernetes-validations", []).append({
                "rule": f"has(self.{name}) == has(oldSelf.{name})",
                "message": f"spec.{name} cannot be added or removed once the job is submitted"})
    return spec


def status_schema() -> dict:
    condition = _obj({"type": _str(), "status": _str(enum=["True", "False", "Unknown"]), "reason": _str(),
                      "message": _str(), "lastTransitionTime": _str(format="date-time"),
                      "observedGeneration": {"type": "integer"}}, required=("type", "status"))
    node = _obj({"id": _str(), "role": _str(enum=["active", "spare", "evicted"]), "index": {"type": "integer"},
                 "pod": _str(), "host": _str(), "alive": {"type": "boolean"}, "dead": _str()}, required=("id",))
    count = {"type": "integer"}
    return _obj({
        "phase": _str(enum=[s.value for s in JobState]),
        "reason": _str("why the job is in this phase"),
        "observedGeneration": count,
        "paused": {"type": "boolean", "description": "the spec.paused the operator last applied"},
        "incarnation": count, "restarts": count, "step": count, "totalSteps": count,
        "loss": {"type": "number"}, "tokensPerSecond": {"type": "number"},
        "ettr": _num(0.0, 1.0, "effective training time ratio: time that trained new steps / wall time since "
                               "submission (the driver's)"),
        "mttrSeconds": _num(0.0, 1e9, "mean time to recover: fault to training caught up, over finished recoveries"),
        "recoveries": count,
        "startTime": _str(format="date-time"), "lastSyncTime": _str(format="date-time"),
        "evictedNodes": {"type": "array", "items": _str(), "description": "the newest Kubernetes nodes evicted "
                                                                          "(the job's pods avoid them; at most 32)"},
        "evictedNodesTotal": {"type": "integer", "description": "Kubernetes nodes evicted, all told"},
        "lastCheckpoint": _obj({"step": count, "uri": _str()}),
        "nextNode": count,
        "nodes": {"type": "array", "items": node},
        "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
    })


def printer_columns() -> list[dict]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
        {"name": "Loss", "type": "number", "jsonPath": ".status.loss"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
        {"name": "ETTR", "type": "number", "jsonPath": ".status.ettr"},
        {"name": "Nodes", "type": "integer", "jsonPath": ".spec.nodes"},
        {"name": "Paused", "type": "boolean", "jsonPath": ".spec.paused", "priority": 1},
        {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict:
    root = _obj({
        "apiVersion": _str(), "kind": _str(),
        "metadata": _obj({"name": _str(maxLength=MAX_NAME, pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$")}),
        "spec": freeze(spec_schema()),
        "status": status_schema(),
    }, required=("spec",), description="A MegaScale training job: executor pods on `nodes` machines, driven to "
                                       "completion through failures by the megascale operator")
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/name": "megascale"}},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": ["tj"], "categories": ["megascale"]},
            "versions": [{"name": VERSION, "served": True, "storage": True, "subresources": {"status": {}},
                          "additionalPrinterColumns": printer_columns(), "schema": {"openAPIV3Schema": root}}],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `python -m megascale.driver.k8s.crd > deploy/crd.yaml`: edit driver/k8s/crd.py instead.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
