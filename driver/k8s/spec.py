"""A TrainingJob, translated: the JobConfig its driver runs, and the Kubernetes objects around its nodes.

Pure functions of the custom resource (a dict, as the API returns it), so the operator, the
backend and the tests build exactly the same objects.

The spec owns where and how the job runs (nodes, devices, parallelism, spares, services, policy,
checkpoint location); the job config, inline or from a ConfigMap, owns what it trains. Where both
name a field, the spec wins (the CRD keeps those fields out of an inline config altogether).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit, urlunsplit

import yaml

from megascale.common.auth import SECRETS_ENV
from megascale.config import RUN_DIR as RUN_DIR_PLACEHOLDER
from megascale.config import ConfigError, ControlConfig, JobConfig, from_dict

from ..backend import NodeLaunch
from . import gang, hardware

GROUP, VERSION, KIND, PLURAL = "megascale.io", "v1alpha1", "TrainingJob", "trainingjobs"
API_VERSION = f"{GROUP}/{VERSION}"

JOB_LABEL, NODE_LABEL = "megascale.io/job", "megascale.io/node"
MANAGED_BY = {"app.kubernetes.io/managed-by": "megascale-operator"}
HOSTNAME_KEY = "kubernetes.io/hostname"
EVICTED_ANNOTATION = "megascale.io/evicted"

WORK_DIR = "/var/lib/megascale/work"  # executor log and rank logs (emptyDir)
# The ranks' run directory (metrics.jsonl, timings, flight records), an emptyDir in each pod; the driver,
# in the operator's pod, keeps its timings store under the same path.
RUN_DIR = "/var/lib/megascale/run"
CONFIG_DIR = "/etc/megascale"  # the resolved job config, for whoever reads a pod
DEVICE_RESOURCE = "nvidia.com/gpu"
SHM_SIZE = "8Gi"  # /dev/shm (memory, counted against the pod's limit) unless spec.shmSize says otherwise
# A machine NotReady this long fails its nodes (spec.nodeNotReadyGraceSeconds): a kubelet that misses a few
# status updates, or restarts, is no failed machine.
NOT_READY_GRACE_S = 60

# The job's own secrets file (megascale.common.auth: its HMAC key, its Redis ACL user and password;
# credentials.py), from a Secret volume: a file, never arguments or env values, which `kubectl describe` prints.
CREDENTIALS_DIR = "/var/run/megascale/credentials"
SECRETS_FILE = "secrets.json"
# Secrets a job asks for in spec.secrets, each under its own name here; only those a namespace admin
# labelled for jobs are mounted (a job author may be unable to read the namespace's other Secrets).
SECRETS_DIR = "/var/run/megascale/secrets"
ALLOW_JOBS_LABEL = "megascale.io/allow-jobs"

# spec.policy field -> (control.* field, default). Pods start slower than local processes (image
# pulls, scheduling), hence a longer start timeout than `megascale run`'s; the rest are `megascale run`'s.
_CONTROL = ControlConfig()
POLICY = {
    "heartbeatSeconds": ("heartbeat_s", _CONTROL.heartbeat_s),
    "deadAfterSeconds": ("dead_after_s", _CONTROL.dead_after_s),
    "maxRestarts": ("max_restarts", _CONTROL.max_restarts),
    "startTimeoutSeconds": ("start_timeout_s", 600.0),
    "commandTimeoutSeconds": ("command_timeout_s", _CONTROL.command_timeout_s),
}

# Config fields the spec owns, by the spec field an error should name.
SPEC_OWNED = {
    "cluster.nodes": "spec.nodes", "cluster.ranks_per_node": "spec.devicesPerNode", "cluster.spares": "spec.spares",
    **{f"parallelism.{k}": f"spec.parallelism.{k}" for k in ("tp", "pp", "dp")},
    **{f"checkpoint.{k}": f"spec.checkpoint.{k}" for k in ("uri", "every", "keep")},
    **{f"services.{k}": f"spec.services.{k}" for k in ("redis", "kafka")},
    **{f"control.{field}": f"spec.policy.{name}" for name, (field, _) in POLICY.items()},
}
# Whole sections the spec stands for, when an error names one without a field.
SPEC_SECTIONS = {"cluster": "spec", "services": "spec.services"}
_SECTIONS = r"(?:model|parallelism|batch|optimizer|precision|data|checkpoint|services|cluster|control|comm|train)"
# A dotted config path anywhere, or a bare section opening the message ("model: expected a mapping").
_CONFIG_PATH = re.compile(rf"(?<![\w.]){_SECTIONS}(?:\.\w+)+|^{_SECTIONS}(?=[:=])")


class SpecError(ValueError):
    """A TrainingJob the operator cannot run; the message is one line naming the spec field."""


@dataclass
class PodPolicy:
    """What the operator's configuration lets a job's pods have, beyond their own spec."""
    service_accounts: frozenset[str] = field(default_factory=frozenset)  # spec.serviceAccountName may name these
    priority_class: Optional[str] = None  # the pods' priorityClassName unless spec.priorityClassName names one


@dataclass
class ServiceDefaults:
    """The operator's own Redis and Kafka, for jobs whose spec names none (deploy/services.yaml)."""
    redis: Optional[str] = None
    kafka: Optional[str] = None


def job_id(namespace: str, name: str) -> str:
    """The job's name in Redis and Kafka: unique across namespaces sharing one Redis."""
    return f"{namespace}.{name}"


def pod_name(name: str, node: str) -> str:
    return f"{name}-{node}"


def config_map_name(name: str) -> str:
    return f"{name}-resolved-config"


def credentials_name(name: str) -> str:
    return f"{name}-credentials"


def redis_user(job: str) -> str:
    """The job's Redis ACL user (credentials.py)."""
    return f"megascale-job-{job}"


# -- spec -> JobConfig ---------------------------------------------------------------------------

def config_source(spec: dict) -> str:
    return "spec.config.inline" if "inline" in (spec.get("config") or {}) else "spec.config.configMapRef"


def base_config(spec: dict, read_config_map: Callable[[str], Optional[dict]]) -> dict:
    """The job config the spec points at, as a dict; `read_config_map(name)` returns a ConfigMap's data."""
    source = spec.get("config") or {}
    if "inline" in source:
        if not isinstance(source["inline"], dict):
            raise SpecError("spec.config.inline: must be a mapping")
        return copy.deepcopy(source["inline"])
    ref = source.get("configMapRef")
    if not isinstance(ref, dict) or not ref.get("name"):
        raise SpecError("spec.config: set either inline or configMapRef.name")
    name, key = ref["name"], ref.get("key") or "config.yaml"
    data = read_config_map(name)
    if data is None:
        raise SpecError(f"spec.config.configMapRef.name={name!r}: no such ConfigMap in the job's namespace")
    if key not in data:
        raise SpecError(f"spec.config.configMapRef.key={key!r}: ConfigMap {name} has no such key "
                        f"(keys: {', '.join(sorted(data)) or 'none'})")
    try:
        raw = yaml.safe_load(data[key]) or {}
    except yaml.YAMLError:
        raise SpecError(f"spec.config.configMapRef: {name}/{key} is not valid YAML") from None
    if not isinstance(raw, dict):
        raise SpecError(f"spec.config.configMapRef: {name}/{key} must hold a mapping")
    return raw


def job_config(cr: dict, base: dict, defaults: ServiceDefaults, run_dir: str = RUN_DIR) -> JobConfig:
    """The JobConfig a TrainingJob runs: `base` (from `base_config`) under the fields the spec owns."""
    spec, meta = cr["spec"], cr["metadata"]
    source = config_source(spec)
    raw = copy.deepcopy(base)
    raw["name"] = job_id(meta["namespace"], meta["name"])
    parallelism = spec.get("parallelism") or {}
    raw["parallelism"] = {**_section(raw, "parallelism", source),
                          **{k: parallelism.get(k, 1) for k in ("tp", "pp", "dp")}}
    raw["cluster"] = {"nodes": spec.get("nodes"), "ranks_per_node": spec.get("devicesPerNode"),
                      "spares": spec.get("spares", 0)}
    policy = spec.get("policy") or {}
    raw["control"] = {**_section(raw, "control", source),
                      **{field: policy.get(name, default) for name, (field, default) in POLICY.items()}}
    checkpoint = spec.get("checkpoint") or {}
    raw["checkpoint"] = {**_section(raw, "checkpoint", source),
                         **{k: checkpoint[k] for k in ("uri", "every", "keep") if k in checkpoint}}
    if hardware.checkpoint_volume(spec) is not None:  # the volume is where checkpoints go, whatever the config says
        raw["checkpoint"]["uri"] = hardware.checkpoint_uri(spec)
    raw["services"] = dict(zip(("redis", "kafka"), services(spec, defaults)))
    raw["train"] = {**_section(raw, "train", source), "run_dir": run_dir}
    if RUN_DIR_PLACEHOLDER in str(raw["checkpoint"].get("uri") or ""):
        field = "spec.checkpoint.uri" if "uri" in checkpoint else f"{source}.checkpoint.uri"
        raise SpecError(f"{field}: \"{RUN_DIR_PLACEHOLDER}\" is each pod's own emptyDir on Kubernetes, lost with "
                        f"the pod: use storage every pod shares (s3://, hdfs://, a shared volume)")
    try:
        return from_dict(raw)
    except ConfigError as e:
        raise SpecError(spec_message(str(e), source)) from None


def services(spec: dict, defaults: ServiceDefaults) -> tuple[str, str]:
    """(Redis URL, Kafka bootstrap) of a job: its spec's, else the operator's."""
    named = spec.get("services") or {}
    found = {"redis": named.get("redis") or defaults.redis, "kafka": named.get("kafka") or defaults.kafka}
    for key, value in found.items():
        if not value:
            raise SpecError(f"spec.services.{key}: not set, and the operator has no default (MEGASCALE_{key.upper()})")
    return found["redis"], found["kafka"]


def _section(raw: dict, name: str, source: str) -> dict:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{source}.{name}: expected a mapping, got {type(value).__name__}")
    return value


def spec_message(message: str, source: str) -> str:
    """A ConfigError's message with config paths renamed to the spec fields a user of the CRD writes."""
    def rename(match: re.Match) -> str:
        path = match.group(0)
        for owned, spec_path in sorted({**SPEC_OWNED, **SPEC_SECTIONS}.items(), key=lambda kv: -len(kv[0])):
            if path == owned or path.startswith(owned + "."):
                return spec_path + path[len(owned):]
        return f"{source}.{path}"
    return _CONFIG_PATH.sub(rename, message)


# -- objects around the job ----------------------------------------------------------------------

def owner_reference(cr: dict) -> dict:
    # No blockOwnerDeletion: it would need `update` on trainingjobs/finalizers, a right used for nothing else.
    meta = cr["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"], "controller": True}


def labels(cr: dict, node: Optional[str] = None) -> dict:
    found = {JOB_LABEL: cr["metadata"]["name"], "app.kubernetes.io/name": "megascale", **MANAGED_BY}
    if node is not None:
        found.update({NODE_LABEL: node, "app.kubernetes.io/component": "executor"})
    return found


def object_metadata(cr: dict, name: str, node: Optional[str] = None) -> dict:
    return {"name": name, "namespace": cr["metadata"]["namespace"], "labels": labels(cr, node),
            "ownerReferences": [owner_reference(cr)]}


def config_map(cr: dict, cfg: JobConfig) -> dict:
    """The resolved job config, mounted read-only in every pod and readable with kubectl."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_metadata(cr, config_map_name(cr["metadata"]["name"])),
            "data": {"config.yaml": yaml.safe_dump(cfg.to_dict(), sort_keys=False)}}


def service(cr: dict) -> dict:
    """Headless: every pod gets `<node>.<job>.<namespace>.svc` (hostname + subdomain), ready or not,
    so ranks can reach each other by name while they rendezvous."""
    name = cr["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_metadata(cr, name),
            "spec": {"clusterIP": "None", "selector": {JOB_LABEL: name}, "publishNotReadyAddresses": True}}


def pod(cr: dict, node: str, launch: NodeLaunch, avoid_hosts: list[str], policy: PodPolicy = PodPolicy()) -> dict:
    """One executor pod. `avoid_hosts` are the Kubernetes nodes evicted from this job: a required node
    anti-affinity keeps its later pods off them even after someone uncordons them. The spec must have
    passed `check_pod_spec` (the CRD schema refuses the same). A priority class (the spec's, else the
    operator's) keeps the scheduler from preempting executors for any pod that merely asks first."""
    spec, name = cr["spec"], cr["metadata"]["name"]
    args = ["-m", "megascale.executor", "--job", launch.job, "--node", node, "--redis", without_login(launch.redis_url),
            "--kafka", launch.kafka, "--work-dir", WORK_DIR, "--heartbeat-s", f"{launch.heartbeat_s:g}",
            "--standby", str(launch.standby), "--ranks-per-node", str(launch.ranks_per_node)]
    env = [{"name": "MEGASCALE_NODE", "value": node},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": SECRETS_ENV, "value": f"{CREDENTIALS_DIR}/{SECRETS_FILE}"},  # the path, not the secrets
           *copy.deepcopy(spec.get("env") or [])]
    secrets = [s["name"] for s in spec.get("secrets") or []]
    container = {
        "name": "executor", "image": spec["image"], "command": ["python"], "args": args, "env": env,
        "resources": _resources(spec),
        "volumeMounts": [{"name": "work", "mountPath": WORK_DIR}, {"name": "run", "mountPath": launch.run_dir},
                         {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True},
                         *({"name": f"secret-{i}", "mountPath": f"{SECRETS_DIR}/{secret}", "readOnly": True}
                           for i, secret in enumerate(secrets))],
        "securityContext": _container_security(spec),
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    body = {
        # Never restarted in place: a node that stops is replaced by a spare, under a new id.
        "restartPolicy": "Never",
        "hostname": node, "subdomain": name,
        "automountServiceAccountToken": False,  # executors never call the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"},
                            **({"runAsNonRoot": True} if spec.get("runAsNonRoot") else {})},
        "affinity": _affinity(name, avoid_hosts),
        "containers": [container],
        "volumes": [{"name": "work", "emptyDir": {}}, {"name": "run", "emptyDir": {}},
                    # NCCL and the node's shared-memory data loader need more than the runtime's 64 MiB /dev/shm;
                    # bounded, as it is memory the pod's limit counts.
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.get("shmSize", SHM_SIZE))}},
                    {"name": "config", "configMap": {"name": config_map_name(name)}},
                    # 0444: every process that can read it is the job's own (one container, its ranks).
                    {"name": "credentials", "secret": {"secretName": credentials_name(name), "defaultMode": 0o444}},
                    *({"name": f"secret-{i}", "secret": {"secretName": secret}} for i, secret in enumerate(secrets))],
    }
    for key in ("nodeSelector", "tolerations", "serviceAccountName"):
        if spec.get(key):
            body[key] = copy.deepcopy(spec[key])
    if priority := priority_class(spec, policy):
        body["priorityClassName"] = priority
    hardware.apply(spec, body, container)  # devices beyond the GPUs, host network, checkpoint volume
    made = {"apiVersion": "v1", "kind": "Pod", "metadata": object_metadata(cr, pod_name(name, node), node),
            "spec": body}
    gang.mark_pod(cr, made)  # scheduler, group, Kueue's gate
    return made


def priority_class(spec: dict, policy: PodPolicy) -> Optional[str]:
    return spec.get("priorityClassName") or policy.priority_class


def pod_group(cr: dict, policy: PodPolicy = PodPolicy()) -> Optional[dict]:
    """The job's PodGroup for its gang scheduler (gang.py), owned by the job; None with spec.scheduling none/kueue."""
    return gang.pod_group(cr, object_metadata(cr, cr["metadata"]["name"]), priority_class(cr["spec"], policy))


def mount_paths() -> dict[str, str]:
    """What every executor pod mounts where (a checkpoint volume must keep clear of these)."""
    return {WORK_DIR: "work directory", RUN_DIR: "run directory", "/dev/shm": "shared memory",
            CONFIG_DIR: "job config", CREDENTIALS_DIR: "credentials", SECRETS_DIR: "secrets"}


def _container_security(spec: dict) -> dict:
    """Nothing but what training needs: IPC_LOCK pins RDMA buffers (spec.rdma), nothing else is added."""
    return {"allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if spec.get("rdma") else {})}}


def without_login(url: str) -> str:
    """`url` without user or password: the operator's own credentials never reach a pod, whose processes log
    in as the job's user from its secrets file."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def check_pod_spec(spec: dict, policy: PodPolicy, secret_labels: Callable[[str], Optional[dict]]) -> None:
    """Refuses (SpecError, naming the field) what would let a job's pods reach beyond the job: env values
    from Secrets or ConfigMaps, Secrets their namespace did not label for jobs, a service account the
    operator's configuration does not list; and what the schema cannot check alone (gang.py, hardware.py: a
    Kueue job without a queue, extended resources, /dev/shm beyond the memory limit, a checkpoint volume the
    uri misses). `secret_labels(name)` is a Secret's labels, None if absent."""
    for i, var in enumerate(spec.get("env") or []):
        source = sorted(set(var.get("valueFrom") or {}) - {"fieldRef"})
        if source:
            raise SpecError(f"spec.env[{i}].valueFrom.{source[0]}: env values are literal or fieldRef only; "
                            f"name a Secret labelled {ALLOW_JOBS_LABEL}=\"true\" in spec.secrets instead")
    for i, secret in enumerate(spec.get("secrets") or []):
        found = secret_labels(secret["name"])
        if found is None:
            raise SpecError(f"spec.secrets[{i}].name={secret['name']!r}: no such Secret in the job's namespace")
        if found.get(ALLOW_JOBS_LABEL) != "true":
            raise SpecError(f"spec.secrets[{i}].name={secret['name']!r}: the Secret is not labelled "
                            f"{ALLOW_JOBS_LABEL}=\"true\" (its namespace's admins decide which Secrets jobs may mount)")
    if why := gang.refusal(spec) or hardware.refusal(spec, mount_paths()):
        raise SpecError(why)
    account = spec.get("serviceAccountName")
    if account and account not in policy.service_accounts:
        allowed = ", ".join(sorted(policy.service_accounts)) or "none"
        raise SpecError(f"spec.serviceAccountName={account!r}: not allowed by the operator (allowed: {allowed}; "
                        f"`megascale kube operator --service-account NAME`)")


def _resources(spec: dict) -> dict:
    # Quantities are strings in a pod (the CRD also takes `cpu: 8`; the client refuses an int before sending it).
    resources = {kind: {name: str(value) for name, value in found.items()}
                 for kind, found in (spec.get("resources") or {}).items()}
    device = spec.get("deviceResource", DEVICE_RESOURCE)
    if device:  # extended resources are set as limits; requests default to them
        resources.setdefault("limits", {})[device] = str(spec["devicesPerNode"])
    return resources


def _affinity(name: str, avoid_hosts: list[str]) -> dict:
    affinity: dict = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100,  # one executor per machine when there is room: a machine failure takes one node, not two
        "podAffinityTerm": {"labelSelector": {"matchLabels": {JOB_LABEL: name}}, "topologyKey": HOSTNAME_KEY}}]}}
    if avoid_hosts:
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            # By node name, not the hostname label: the two may differ, and cordoning is by name.
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": sorted(avoid_hosts)}]}]}}
    return affinity
