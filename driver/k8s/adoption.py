"""Step 1 of the operator's pass, once per job: adoption. The job's config is resolved (a job that runs
already keeps the one it was submitted with), its pod spec checked, and it is submitted to Redis, found
there, or re-seeded from its status when its record was lost; its ConfigMap, Service, credentials and
NetworkPolicy are applied (credentials.py). What the operator then holds for it is a Runtime.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megascale.checkpoint.storage import CheckpointError, StorageUnreadable, check_checkpoint_uri
from megascale.config import JobConfig, from_dict

from .. import log
from ..state import JobRecord, JobState, JobStore
from . import api_retry, credentials
from . import status as job_status
from .backend import K8sState
from .caches import PodCache
from .crd import LIVE_FIELDS
from .ownership import Leftover, owned_by
from .spec import (
    JOB_LABEL,
    SpecError,
    base_config,
    check_pod_spec,
    config_map,
    job_config,
    job_id,
    service,
    services,
)

if TYPE_CHECKING:
    from .operator import Operator


def frozen(spec: dict) -> dict:
    """The spec's fields the job is held to once submitted (the CRD refuses edits of them)."""
    return {k: v for k, v in spec.items() if k not in LIVE_FIELDS}


@dataclass
class Runtime:
    """What the operator holds for one adopted TrainingJob (all of it recoverable from status + Redis)."""
    namespace: str
    name: str
    uid: str
    store: JobStore
    state: K8sState
    redis_url: str
    kafka: str
    paused: Optional[bool]  # spec.paused last applied; None: not yet
    status: dict  # as last written
    frozen: dict = field(default_factory=dict)  # the spec's frozen fields as adopted (the rest: crd.LIVE_FIELDS)
    pods: Optional[PodCache] = None  # the job's pods from the operator's informer, for its driver (made if None)
    proc: Optional[subprocess.Popen] = None
    starts: list[float] = field(default_factory=list)
    written: float = 0.0
    missing_since: dict[str, float] = field(default_factory=dict)
    checkpoint: Optional[dict] = None
    checkpoint_checked: float = 0.0
    held: str = ""
    retire_by: float = 0.0
    expiring: bool = False  # the finished job's Redis keys have a TTL
    secrets_file: Optional[Path] = None  # the job's secrets (megascale.common.auth), for its driver
    reported: dict[str, str] = field(default_factory=dict)  # node -> the failure last reported as an Event

    def __post_init__(self) -> None:
        self.pods = self.pods or PodCache(self.store.r, self.store.job)

    @property
    def job(self) -> str:
        return self.store.job



def adopt(op: Operator, cr: dict) -> Optional[Runtime]:
    """Step 1, once per job: its config resolved, its pod spec checked, submitted to Redis (or found there,
    or re-seeded from its status), its ConfigMap, Service and credentials applied. None: not now (the
    status says why, or a predecessor's objects are still being collected)."""
    meta, spec, previous = cr["metadata"], cr["spec"], cr.get("status") or {}
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    try:
        check_pod_spec(spec, op.pod_policy, lambda secret: op.kube.secret_labels(namespace, secret))
        redis_url, kafka = services(spec, op.defaults)
        store = JobStore.from_url(redis_url, job_id(namespace, name))
        state = K8sState(store.r, store.job)
        rec = store.load()
        resuming = rec is not None and state.uid() == uid
        ran = previous.get("nextNode") or previous.get("phase") not in (None, JobState.PENDING.value)
        # A job that runs already keeps the config it was submitted with, whatever became of its source.
        cfg = from_dict(rec.config) if resuming else job_config(
            cr, base_config(spec, lambda cm: op.kube.config_map_data(namespace, cm)), op.defaults, op.run_dir)
        if not resuming and not ran:
            _check_fresh_start(store.job, cfg)
        # Before anything starts: a name taken by someone else's Service stops the job here.
        op.kube.apply_owned("ConfigMap", namespace, config_map(cr, cfg))
        op.kube.apply_owned("Service", namespace, service(cr))
        secrets_file = _credentials(op, cr, store)
    except (SpecError, CheckpointError) as e:
        invalid(op, cr, str(e))
        return None
    except Leftover as e:  # the garbage collector takes it soon; adopted on a later pass
        op._say((namespace, name), f"{namespace}/{name}: {e}")
        return None
    except api_retry.Refused as e:  # the user's to fix (a quota, RBAC, an admission policy); tried every pass
        refused(op, cr, e)
        return None
    paused = previous.get("paused")
    if resuming:
        log.info("job %s: resuming it (%s, incarnation %d)", store.job, rec.state.value, rec.incarnation)
    elif ran:
        rec, paused = _reseed(op, cr, store, state, cfg.to_dict()), None
    else:
        state.wipe()  # whatever an older job of this name left
        state.set_uid(uid)
        rec, _ = store.submit(JobRecord(job=store.job, config=cfg.to_dict(), run_dir=op.run_dir))
        paused = None
        log.info("job %s: submitted (%d nodes, %d spares)", store.job, cfg.cluster.nodes, cfg.cluster.spares)
    op._said.pop((namespace, name), None)
    op._said.pop((namespace, name, "refused"), None)
    return Runtime(namespace, name, uid, store, state, redis_url, kafka, paused, previous, frozen(spec),
                   PodCache(store.r, store.job), checkpoint=previous.get("lastCheckpoint"), secrets_file=secrets_file)

def _credentials(op: Operator, cr: dict, store: JobStore) -> Path:
    """Provisions the job's credentials; returns its secrets file for the driver (the HMAC key checks
    the heartbeats)."""
    job_secrets = credentials.provision(op.kube, cr, store.r, store.job)
    path = op.workdir / f"{store.job}.secret"  # type: ignore[operator] - set while the operator runs
    job_secrets.write(path)
    return path

def _check_fresh_start(job: str, cfg: JobConfig) -> None:
    """As `megascale launch` does: a new job does not restart into another run's checkpoints. Storage
    this pod cannot list (only the executors hold its credentials or volume) is the user's to vouch for."""
    try:
        check_checkpoint_uri(cfg.checkpoint.uri, cfg.checkpoint.resume, cfg.checkpoint.filesystem,
                             cfg.checkpoint.filesystem_options)
    except StorageUnreadable as e:
        log.warning("job %s: not checked for an earlier run's checkpoints: %s", job, e)

def _reseed(op: Operator, cr: dict, store: JobStore, state: K8sState, config: dict) -> JobRecord:
    """The job ran (its status says so) but Redis has no record of it: start it again from what the
    status kept (incarnation, restarts, node ids, evicted machines), on new pods: the old ones'
    commands and acknowledgements went with the record."""
    meta, previous = cr["metadata"], cr["status"]
    for pod in op.kube.list_pods(meta["namespace"], f"{JOB_LABEL}={meta['name']}"):
        if owned_by(pod, meta["uid"]):  # a predecessor's go with it, by the garbage collector
            op.kube.delete_pod(meta["namespace"], pod["metadata"]["name"], uid=pod["metadata"]["uid"])
    state.wipe()
    state.set_uid(meta["uid"])
    state.add_evicted_hosts(*previous.get("evictedNodes", []))
    rec = JobRecord(job=store.job, config=config, run_dir=op.run_dir, incarnation=previous.get("incarnation", 0),
                    restarts=previous.get("restarts", 0), next_node=previous.get("nextNode", 0),
                    reason="re-seeded from the TrainingJob status: its Redis record was lost")
    store.submit(rec)
    log.warning("job %s: no record in Redis; re-seeded from its status (incarnation %d, restarts %d, "
                "next node n%d)", store.job, rec.incarnation, rec.restarts, rec.next_node)
    return rec

def invalid(op: Operator, cr: dict, message: str) -> None:
    """A spec the schema let through but the operator cannot run (a missing ConfigMap, a config error):
    the job waits in Pending, saying why, until the spec or the ConfigMap is fixed."""
    meta, previous = cr["metadata"], cr.get("status") or {}
    op._say((meta["namespace"], meta["name"]), f"{meta['namespace']}/{meta['name']}: {message}")
    if previous.get("reason") == message and previous.get("observedGeneration") == meta.get("generation"):
        return
    cond = {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": message,
            "lastTransitionTime": job_status.iso(time.time())}
    others = [c for c in previous.get("conditions") or [] if c.get("type") != "Valid"]
    op.kube.patch_job_status(meta["namespace"], meta["name"], {
        "phase": previous.get("phase") or JobState.PENDING.value, "reason": message,
        "observedGeneration": meta.get("generation"), "conditions": [*others, cond]})


def refused(op: Operator, cr: dict, e: api_retry.Refused) -> None:
    """The API server refused one of the job's objects at adoption: the FailedCreateObject condition (reason
    FailedCreate<Kind>) and a Warning Event with its message, once per message; adoption is tried again on
    every pass, and the condition goes False once the job is adopted (operator._write_status)."""
    meta, previous = cr["metadata"], cr.get("status") or {}
    key, message = (meta["namespace"], meta["name"], "refused"), f"{e.kind} {e.name}: {api_retry.message(e)}"
    if op._said.get(key) == message:
        return
    cond = {"type": "FailedCreateObject", "status": "True", "reason": f"FailedCreate{e.kind}", "message": message,
            "lastTransitionTime": job_status.iso(time.time())}
    others = [c for c in previous.get("conditions") or [] if c.get("type") != cond["type"]]
    op.kube.patch_job_status(meta["namespace"], meta["name"], {
        "phase": previous.get("phase") or JobState.PENDING.value, "conditions": [*others, cond]})
    op.kube.create_event(cr, "Warning", cond["reason"], message)
    op._said[key] = message
    log.warning("%s/%s: %s", meta["namespace"], meta["name"], message)
