"""Per-job credentials and network isolation: jobs share one Redis and one Kafka, and each job's pods run
its author's image, so nothing a pod holds may reach another job's keys or pods.

For each TrainingJob the operator makes
- a Redis ACL user that may touch only the job's keys (`megascale:{<job>}:...`, the job's records and
  command streams, and `megascale:{<job>/<incarnation>}:...`, its rendezvous), with no administrative or
  dangerous commands and no pub/sub channels; made with the operator's own (admin) Redis credentials,
  removed when the job is deleted
- a Secret, owned by the job (deleted with it), holding the job's secrets file (megascale.common.auth:
  that user, its password, the job's HMAC key), mounted into the job's pods (spec.py: CREDENTIALS_DIR)
- a NetworkPolicy letting the job's pods receive only from each other (deploy/networkpolicy.yaml allows
  their way out to Redis, Kafka and DNS, and nothing else)
"""
from __future__ import annotations

import base64
import dataclasses
import json
import secrets
from typing import TYPE_CHECKING, Optional

import redis

from megascale.common.auth import JobSecrets

from .spec import JOB_LABEL, SECRETS_FILE, credentials_name, object_metadata, redis_user

if TYPE_CHECKING:
    from .kube import Kube


def provision(kube: Kube, cr: dict, admin: redis.Redis, job: str) -> JobSecrets:
    """The job's Secret (kept across operator restarts: running pods hold it; renewed for a re-created job of
    the same name), its Redis user (`admin`: the operator's own login) and its NetworkPolicy."""
    meta = cr["metadata"]
    existing = kube.secret(meta["namespace"], credentials_name(meta["name"]))
    owners = [ref.get("uid") for ref in ((existing or {}).get("metadata") or {}).get("ownerReferences") or []]
    job_secrets = (read_secret(existing, job) if meta["uid"] in owners else None) or new_secrets(job)
    kube.apply_owned("Secret", meta["namespace"], secret(cr, job_secrets))
    ensure_redis_user(admin, job, job_secrets.redis_password)
    kube.apply_owned("NetworkPolicy", meta["namespace"], network_policy(cr))
    return job_secrets


def key_patterns(job: str) -> list[str]:
    """Redis key patterns of a job: `}` and `/` after the name, so job `a.b` never matches job `a.b2`."""
    return [f"megascale:{{{job}}}*", f"megascale:{{{job}/*"]


def acl_rules(job: str, password: str) -> list[str]:
    # `reset` first: an ACL SETUSER repeated by a restarted operator leaves no rule of an earlier version.
    return ["reset", "on", f">{password}", *(f"~{p}" for p in key_patterns(job)), "resetchannels",
            "+@all", "-@admin", "-@dangerous"]


def ensure_redis_user(admin: redis.Redis, job: str, password: str) -> None:
    admin.execute_command("ACL", "SETUSER", redis_user(job), *acl_rules(job, password))


def drop_redis_user(admin: redis.Redis, job: str) -> None:
    admin.execute_command("ACL", "DELUSER", redis_user(job))


def new_secrets(job: str) -> JobSecrets:
    return JobSecrets(secrets.token_hex(32), redis_user(job), secrets.token_urlsafe(32))


def secret(cr: dict, job_secrets: JobSecrets) -> dict:
    text = json.dumps(dataclasses.asdict(job_secrets))
    body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_metadata(cr, credentials_name(cr["metadata"]["name"])),
            "data": {SECRETS_FILE: base64.b64encode(text.encode()).decode()}}
    body["metadata"]["labels"]["app.kubernetes.io/component"] = "credentials"
    return body


def read_secret(obj: Optional[dict], job: str) -> Optional[JobSecrets]:
    """The job's secrets from its credentials Secret; None unless complete and for this job's Redis user."""
    try:
        data = json.loads(base64.b64decode(((obj or {}).get("data") or {})[SECRETS_FILE]))
        found = JobSecrets(str(data["hmac_key"]), data["redis_username"], data["redis_password"])
    except (KeyError, TypeError, ValueError):
        return None
    return found if found.redis_username == redis_user(job) and found.redis_password else None


def network_policy(cr: dict) -> dict:
    """The job's pods reach each other (NCCL, gloo, rendezvous peers); policies add up, so with
    deploy/networkpolicy.yaml nothing else reaches them, and they reach only this, Redis, Kafka and DNS."""
    name = cr["metadata"]["name"]
    mine = {"podSelector": {"matchLabels": {JOB_LABEL: name}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_metadata(cr, f"{name}-pods"),
            "spec": {**mine, "policyTypes": ["Ingress", "Egress"], "ingress": [{"from": [mine]}],
                     "egress": [{"to": [mine]}]}}
