"""The Kubernetes API as megascale uses it, through the official client: raw JSON objects (the same
dicts the manifests are written as), 404 as None, 409 on create as "already there" once the object is
read back and found to be the same owner's (ownership.py), transient errors retried (api_retry.py),
lists read in pages, writes fenced by the operator's Lease (leader.py), and Events. (The operator's caches:
informer.py.)
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Callable, Optional

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .. import log
from . import api_retry
from .caches import PodCache
from .leader import Fence
from .ownership import Leftover, NotOwned, controller_uid
from .spec import GROUP, JOB_LABEL, MANAGED_BY, PLURAL, VERSION, SpecError

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
REQUEST_TIMEOUT_S = 15
PAGE = 500  # objects per list request, as client-go's pager asks: no single answer grows with the cluster
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def connect(kubeconfig: Optional[str] = None, context: Optional[str] = None,
            retries: Optional[int] = None) -> client.ApiClient:
    """Inside a pod, its service account (unless a kubeconfig is named); elsewhere the kubeconfig
    ($KUBECONFIG or ~/.kube/config), as kubectl does. `retries`: of a failed call (api_retry.policy)."""
    configuration = client.Configuration()
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    configuration.retries = api_retry.policy(retries)  # 429, 5xx, timeouts: retried with backoff for every call
    return client.ApiClient(configuration)


def current_namespace(kubeconfig: Optional[str] = None, context: Optional[str] = None) -> str:
    """kubectl's default namespace: the pod's own, else the kubeconfig context's, else "default"."""
    if kubeconfig is None and os.path.exists(SA_NAMESPACE) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        with open(SA_NAMESPACE) as f:
            return f.read().strip()
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c["name"] == context), None) if context else active
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def reason(e: ApiException) -> str:
    """The API server's one-line message (its Status body), else the HTTP reason."""
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


class Kube:
    """The calls the operator, the backend and the CLI make; objects in and out are plain dicts.

    `fence`: the operator's and its drivers' (leader.py): every write checks it first and raises NotLeader
    when the Lease is no longer held. `pods`: the operator's pod cache, which `job_pods` reads (a driver)."""

    def __init__(self, api: client.ApiClient, fence: Optional[Fence] = None, pods: Optional[PodCache] = None):
        self.api, self.fence, self.pod_cache = api, fence, pods
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.networking = client.NetworkingV1Api(api)
        self.extensions = client.ApiextensionsV1Api(api)

    @staticmethod
    def _data(resp) -> dict:
        return json.loads(resp.data)

    def fenced(self, fence: Fence) -> "Kube":
        """The same client, its writes fenced."""
        return Kube(self.api, fence, self.pod_cache)

    def _write(self, what: str) -> None:
        if self.fence is not None:
            self.fence.check(what)

    def _list(self, call: Callable, *args, **kwargs) -> dict:
        """Every page of a list (limit + continue); the items of all, the resourceVersion of the first."""
        listing, token = None, None
        while True:
            page = self._data(call(*args, **kwargs, limit=PAGE, **({"_continue": token} if token else {}),
                                   _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))
            if listing is None:
                listing = page
            else:
                listing["items"] += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return listing

    def _get(self, call: Callable, *args) -> Optional[dict]:
        try:
            return self._data(call(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # -- TrainingJobs ----------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> Optional[dict]:
        return self._get(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)

    def list_jobs(self, namespace: Optional[str]) -> list[dict]:
        try:
            if namespace:
                found = self._list(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL)
            else:
                found = self._list(self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        except ApiException as e:
            if e.status == 404:  # no CRD
                return []
            raise
        return found.get("items", [])

    def patch_job(self, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of the resource, as `kubectl patch --type merge` sends."""
        self._write("patching a TrainingJob")
        return self._data(self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, patch, _content_type=MERGE, _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_S))

    def patch_job_status(self, namespace: str, name: str, status: dict) -> dict:
        self._write(f"writing the status of {namespace}/{name}")
        return self._data(self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _content_type=MERGE, _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_S))

    # -- pods, Services, ConfigMaps ------------------------------------------------------------------

    def create_pod(self, namespace: str, body: dict) -> bool:
        """False when the pod exists already with the same controller (a restarted driver creating it again,
        or a retried create whose first answer was lost); NotOwned when it is another owner's (a deleted job's
        pod of the same name, still terminating)."""
        self._write(f"creating pod {body['metadata']['name']}")
        for _ in range(2):  # a pod deleted between the 409 and the read: create it again, once
            if self._create(self.core.create_namespaced_pod, namespace, body):
                return True
            existing = self.read_pod(namespace, body["metadata"]["name"])
            if existing is None:
                continue
            mine, theirs = controller_uid(body), controller_uid(existing)
            if theirs != mine:
                raise NotOwned(f"pod {namespace}/{body['metadata']['name']} exists with owner UID {theirs}, not "
                               f"{mine} (a deleted job's, still terminating?)")
            return False
        return False

    def list_pods(self, namespace: str, selector: str, field_selector: Optional[str] = None) -> list[dict]:
        return self._list(self.core.list_namespaced_pod, namespace, label_selector=selector,
                          **({"field_selector": field_selector} if field_selector else {})).get("items", [])

    def job_pods(self, namespace: str, name: str) -> list[dict]:
        """A job's pods (by its label; not yet by owner) from the operator's cache (caches.py), else listed."""
        cached = self.pod_cache.read() if self.pod_cache is not None else None
        return cached if cached is not None else self.list_pods(namespace, f"{JOB_LABEL}={name}")

    def read_pod(self, namespace: str, name: str) -> Optional[dict]:
        """The pod as stored now, not as a watch cache has it (a list without resourceVersion is a quorum
        read; by name through a field selector, so `list` is the only right it takes)."""
        found = self.list_pods(namespace, "", field_selector=f"metadata.name={name}")
        return found[0] if found else None

    def delete_pod(self, namespace: str, name: str, grace_s: Optional[float] = None, uid: Optional[str] = None) -> bool:
        """False when it was gone already, or (`uid` given) is another pod of that name now."""
        self._write(f"deleting pod {name}")
        try:
            grace = None if grace_s is None else int(grace_s)
            body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)) if uid else None
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace, body=body,
                                            _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
            return True
        except ApiException as e:
            if e.status == 404 or (e.status == 409 and uid):
                return False
            raise

    def apply_owned(self, kind: str, namespace: str, body: dict) -> None:
        """Creates a job's Service, ConfigMap, Secret or NetworkPolicy; one already there is merge-patched if its
        controller is this job (by UID), left for the garbage collector if it was a deleted job's of the same name
        (Leftover: try again later), and refused if it is anybody else's (SpecError). A refusal by the API server
        (403: RBAC, a quota; 422) raises api_retry.Refused, naming the object."""
        self._write(f"writing {kind} {body['metadata']['name']}")
        try:
            self._apply_owned(kind, namespace, body)
        except ApiException as e:
            if api_retry.refused(e):
                raise api_retry.Refused(kind, body["metadata"]["name"], e) from e
            raise

    def _apply_owned(self, kind: str, namespace: str, body: dict) -> None:
        create, read, patch = {
            "Service": (self.core.create_namespaced_service, self.core.read_namespaced_service,
                        self.core.patch_namespaced_service),
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.read_namespaced_config_map,
                          self.core.patch_namespaced_config_map),
            "Secret": (self.core.create_namespaced_secret, self.core.read_namespaced_secret,
                       self.core.patch_namespaced_secret),
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.read_namespaced_network_policy,
                              self.networking.patch_namespaced_network_policy)}[kind]
        if self._create(create, namespace, body):
            return
        name, ours = body["metadata"]["name"], body["metadata"]["labels"]
        existing = self._get(read, name, namespace)
        if existing is None:  # deleted in between
            self._create(create, namespace, body)
            return
        labels = existing["metadata"].get("labels") or {}
        if any(labels.get(k) != ours[k] for k in (JOB_LABEL, *MANAGED_BY)):
            raise SpecError(f"metadata.name: a {kind} {namespace}/{name} exists that the megascale operator did not "
                            f"make for this job; rename the TrainingJob or that {kind}")
        if controller_uid(existing) != controller_uid(body):
            raise Leftover(f"{kind} {namespace}/{name} still belongs to a deleted TrainingJob of the same name "
                           f"(UID {controller_uid(existing)}); waiting for the garbage collector")
        patch(name, namespace, {k: v for k, v in body.items() if k not in ("apiVersion", "kind")},
              _content_type=MERGE, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)

    def config_map_data(self, namespace: str, name: str) -> Optional[dict]:
        found = self._get(self.core.read_namespaced_config_map, name, namespace)
        return None if found is None else found.get("data") or {}

    def secret(self, namespace: str, name: str) -> Optional[dict]:
        return self._get(self.core.read_namespaced_secret, name, namespace)

    def secret_labels(self, namespace: str, name: str) -> Optional[dict]:
        found = self.secret(namespace, name)
        return None if found is None else found["metadata"].get("labels") or {}

    def _create(self, call: Callable, namespace: str, body: dict) -> bool:
        try:
            call(namespace, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    def create_event(self, involved: dict, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on `involved` (a TrainingJob), as `kubectl describe` and `get events` show them.
        Best effort: an Event that cannot be written is logged, never fatal."""
        meta = involved["metadata"]
        try:
            self._write(f"recording the Event {reason}")
        except ApiException as e:
            log.warning("%s", api_retry.message(e))
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {"apiVersion": "v1", "kind": "Event", "type": kind, "reason": reason, "message": message[:1024],
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": involved.get("apiVersion", f"{GROUP}/{VERSION}"),
                                   "kind": involved.get("kind", "TrainingJob"), "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta.get("uid")},
                "source": {"component": "megascale-operator"}, "reportingComponent": "megascale.io/operator",
                "reportingInstance": socket.gethostname(), "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False,
                                              _request_timeout=REQUEST_TIMEOUT_S)
        except api_retry.API_ERRORS as e:
            log.warning("could not record the Event %s on %s/%s: %s", reason, meta["namespace"], meta["name"],
                        api_retry.message(e))

    # -- nodes ---------------------------------------------------------------------------------

    def cordon(self, node: str, why: str) -> None:
        """Unschedulable for everyone (a strategic merge patch, as `kubectl cordon` sends), with the reason
        in an annotation for whoever repairs the machine. No taint: a taint patch replaces the node's list."""
        from .spec import EVICTED_ANNOTATION

        self._write(f"cordoning {node}")
        patch = {"metadata": {"annotations": {EVICTED_ANNOTATION: why}}, "spec": {"unschedulable": True}}
        self.core.patch_node(node, patch, _content_type=STRATEGIC, _preload_content=False,
                             _request_timeout=REQUEST_TIMEOUT_S)

    # -- the CustomResourceDefinition (people with cluster rights: `megascale kube apply-crd`) ---------

    def apply_crd(self, body: dict) -> str:
        self._write("applying the CRD")
        name = body["metadata"]["name"]
        existing = self._get(self.extensions.read_custom_resource_definition, name)
        if existing is None:
            self.extensions.create_custom_resource_definition(body, _preload_content=False,
                                                              _request_timeout=REQUEST_TIMEOUT_S)
            return "created"
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": existing["metadata"]["resourceVersion"]}}
        self.extensions.replace_custom_resource_definition(name, body, _preload_content=False,
                                                           _request_timeout=REQUEST_TIMEOUT_S)
        return "replaced"
