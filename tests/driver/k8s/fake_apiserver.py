"""A stand-in Kubernetes API server: a threaded http.server on 127.0.0.1 speaking the real REST and
watch protocol to the official `kubernetes` client (no real API server can run here).

Like the real one:
- pods, services, configmaps, secrets, networkpolicies, events, leases (namespaced); nodes and customresourcedefinitions
  (cluster); and the custom resources of every CRD created through it, with their status subresource
- get, list (labelSelector a=b,c=d), create (409 AlreadyExists), update (PUT, resourceVersion
  checked), delete (404 NotFound with a Status body), merge and strategic-merge patches
- resourceVersion on every change; metadata.generation on spec changes; PATCH on a resource
  ignores its .status and PATCH on /status changes only .status
- watch=true: a chunked stream of {"type","object"} lines after a resourceVersion (410 Gone before
  the compacted one), ended at timeoutSeconds (with a BOOKMARK when allowWatchBookmarks is set)
- admission of custom resources with the CRD's schema: defaults, then validation, 422 Invalid
  (schema_tools: jsonschema, unknown fields refused, CEL rules by a Python stand-in)
- bearer-token users; RBAC from Role/ClusterRole + bindings for non-admins (403 Forbidden), every
  request recorded as (user, verb, group, resource, namespace) for least-privilege checks
- graceful pod deletion (deletionTimestamp; the kubelet stand-in finishes it, grace 0 forces it), delete
  preconditions (uid: 409 Conflict for another object of the name), and garbage collection of objects
  whose ownerReferences name a deleted object: at once, or (`gc = False`) when `collect_garbage()` runs,
  as the real collector does some time later
- events (core/v1), and the field selector metadata.name=<name> on lists
- the Eviction API (pods/<name>/eviction, as `kubectl drain` calls it): a DisruptionTarget condition, then a
  graceful delete

Switchable per test, as real clusters behave (fake_behaviours.py): injected errors, pods ended as the
kubelet ends them, NotReady machines (after the node-monitor grace period), Pod Security admission, paginated
lists with expiring continue tokens, dropped watches.

Simplified: strategic merge replaces lists; no other field selectors, set-based selectors, JSON patch,
server-side apply, discovery or webhooks.
"""
from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import parse_qs, urlparse

from fake_behaviours import ApiError, Behaviours
from schema_tools import Invalid, admit


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


BUILTIN = [Kind("", "v1", "pods", "Pod", True), Kind("", "v1", "services", "Service", True),
           Kind("", "v1", "configmaps", "ConfigMap", True), Kind("", "v1", "secrets", "Secret", True),
           Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True),
           Kind("", "v1", "events", "Event", True), Kind("coordination.k8s.io", "v1", "leases", "Lease", True),
           Kind("", "v1", "nodes", "Node", False),
           Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False)]


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def matches(labels: dict, selector: Optional[str]) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip().lstrip("="):
            return False
    return True


class FakeApiServer(Behaviours):
    def __init__(self):
        self.kinds: dict[tuple[str, str], Kind] = {(k.group, k.plural): k for k in BUILTIN}
        self.schemas: dict[tuple[str, str], dict] = {}
        self.objects: dict[tuple[str, str, str, str], dict] = {}  # (group, plural, namespace, name)
        self.log: list[tuple[int, str, tuple, dict]] = []  # (rv, event type, key, object)
        self.rv, self.compacted = 0, 0
        self.cond = threading.Condition()
        self.users: dict[str, tuple[str, bool]] = {}  # token -> (user, admin)
        self.grants: dict[str, list[tuple[Optional[str], dict]]] = {}  # user -> [(namespace or None, rule)]
        self.requests: list[tuple[str, str, str, str, Optional[str], int]] = []
        self.on_pod_delete: Optional[Callable[[dict], bool]] = None  # the kubelet: True = it finishes the delete
        self.gc = True  # False: dependents of deleted objects stay until collect_garbage()
        self.faults: list[list] = []  # [verb, plural, code, message, retry_after, times left]
        self.closed = False
        self.httpd: Optional[ThreadingHTTPServer] = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "FakeApiServer":
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                api.handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that hung up (a stopped watch): nothing to report

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.httpd:
            self.httpd.shutdown()
            self.httpd.server_close()

    def add_user(self, token: str, user: str, admin: bool = False) -> None:
        self.users[token] = (user, admin)

    def load_rbac(self, docs: list[dict]) -> None:
        """Grants from Role/ClusterRole documents to the subjects of their bindings (ServiceAccounts)."""
        roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules", [])
                 for d in docs if d["kind"] in ("Role", "ClusterRole")}
        for d in docs:
            if d["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            ref = d["roleRef"]
            ns = d["metadata"].get("namespace") if d["kind"] == "RoleBinding" else None
            rules = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
            for s in d["subjects"]:
                user = f"system:serviceaccount:{s['namespace']}:{s['name']}"
                self.grants.setdefault(user, []).extend((ns, rule) for rule in rules)

    # -- direct access for tests (no HTTP, no RBAC) ------------------------------------------------

    def get(self, plural: str, name: str, namespace: Optional[str] = None, group: str = "") -> Optional[dict]:
        with self.cond:
            obj = self.objects.get((group, plural, namespace or "", name))
            return copy.deepcopy(obj) if obj else None

    def list(self, plural: str, namespace: Optional[str] = None, selector: Optional[str] = None,
             group: str = "") -> list[dict]:
        with self.cond:
            return [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self.objects.items())
                    if g == group and p == plural and (namespace is None or ns == namespace)
                    and matches(o["metadata"].get("labels") or {}, selector)]

    def put(self, obj: dict) -> dict:
        """Creates an object as an admin would (tests: machines)."""
        group, _, _ = obj["apiVersion"].rpartition("/")
        kind = next(k for k in self.kinds.values() if k.kind == obj["kind"] and k.group == group)
        with self.cond:
            return self._create(kind, obj["metadata"].get("namespace"), copy.deepcopy(obj))

    def update(self, plural: str, name: str, namespace: Optional[str], change: Callable[[dict], None],
               group: str = "") -> Optional[dict]:
        """Applies `change` to the stored object in place (tests: the scheduler and kubelet stand-in)."""
        with self.cond:
            key = (group, plural, namespace or "", name)
            if key not in self.objects:
                return None
            obj = copy.deepcopy(self.objects[key])
            change(obj)
            return self._store(key, obj, "MODIFIED")

    def remove(self, plural: str, name: str, namespace: Optional[str], group: str = "") -> None:
        with self.cond:
            self._remove((group, plural, namespace or "", name))

    # -- the store (called with self.cond held) -------------------------------------------------------

    def _store(self, key: tuple, obj: dict, event: str) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self.log.append((self.rv, event, key, copy.deepcopy(obj)))
        self.cond.notify_all()
        return copy.deepcopy(obj)

    def _create(self, kind: Kind, namespace: Optional[str], obj: dict) -> dict:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{kind.kind}: metadata.name: Required value")
        key = (kind.group, kind.plural, namespace or "", name)
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{kind.plural}{"." + kind.group if kind.group else ""} "{name}" '
                                                 f"already exists")
        if kind.namespaced:
            meta["namespace"] = namespace
        obj = self._admit(kind, obj)
        if kind.plural == "pods":
            self.admit_pod(namespace, obj)  # PodSecurity, where a test enforces it
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), generation=1,
                    creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if kind.plural == "pods":
            obj.setdefault("status", {"phase": "Pending"})
        if kind.plural == "customresourcedefinitions":
            self._register(obj)
        return self._store(key, obj, "ADDED")

    def _register(self, crd: dict) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                kind = Kind(spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
                            spec["scope"] == "Namespaced", "status" in (version.get("subresources") or {}))
                self.kinds[(kind.group, kind.plural)] = kind
                self.schemas[(kind.group, kind.plural)] = version["schema"]["openAPIV3Schema"]

    def _admit(self, kind: Kind, obj: dict, old: Optional[dict] = None) -> dict:
        schema = self.schemas.get((kind.group, kind.plural))
        if schema is None:
            return obj
        try:
            return admit(schema, obj, old)
        except Invalid as e:
            raise ApiError(422, "Invalid", f'{kind.kind}.{kind.group} "{obj["metadata"].get("name")}" is invalid: {e}')

    def _remove(self, key: tuple) -> None:
        obj = self.objects.pop(key, None)
        if obj is None:
            return
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.log.append((self.rv, "DELETED", key, copy.deepcopy(obj)))
        self.cond.notify_all()
        uid = obj["metadata"]["uid"]  # garbage collection: dependents go with their owner
        for other_key, other in list(self.objects.items()) if self.gc else []:
            if any(ref.get("uid") == uid for ref in other["metadata"].get("ownerReferences") or []):
                self._delete(other_key, None)

    def _delete(self, key: tuple, grace: Optional[int]) -> dict:
        obj = self.objects[key]
        if key[1] == "pods" and grace != 0 and obj["spec"].get("nodeName") and self.on_pod_delete:
            if obj["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(obj)
            obj = copy.deepcopy(obj)
            obj["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            obj["metadata"]["deletionGracePeriodSeconds"] = (
                grace if grace is not None else obj["spec"].get("terminationGracePeriodSeconds", 30))
            stored = self._store(key, obj, "MODIFIED")
            if self.on_pod_delete(stored):
                return stored
        self._remove(key)
        return copy.deepcopy(obj)

    # -- HTTP ----------------------------------------------------------------------------------

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlparse(req.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = None
        if int(req.headers.get("Content-Length") or 0):
            body = json.loads(req.rfile.read(int(req.headers["Content-Length"])))
        try:
            route = self._route(url.path)
            if route is None:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
            kind, namespace, name, sub = route
            verb = {"GET": "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list"),
                    "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[req.command]
            resource = kind.plural + (f"/{sub}" if sub else "")
            user = self._authorize(req, verb, kind, resource, namespace)
            if verb == "watch":
                self.requests.append((user, verb, kind.group, resource, namespace, 200))
                return self._watch(req, kind, namespace, query)
            fault = self._fault(verb, resource)
            if fault is not None:
                self.requests.append((user, verb, kind.group, resource, namespace, fault[0].code))
                headers = {"Retry-After": str(fault[1])} if fault[1] is not None else {}
                return self._reply(req, fault[0].code, fault[0].status(), headers)
            code, result = self._serve(req, verb, kind, namespace, name, sub, query, body)
            self.requests.append((user, verb, kind.group, resource, namespace, code))
        except ApiError as e:
            code, result = e.code, e.status()
        except KeyError as e:
            code, result = 400, ApiError(400, "BadRequest", f"missing {e}").status()
        self._reply(req, code, result)

    def _route(self, path: str) -> Optional[tuple[Kind, Optional[str], Optional[str], Optional[str]]]:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[0] == "apis" and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        kind = self.kinds.get((group, rest[0])) if rest else None
        if kind is None or kind.version != version or len(rest) > 3 or (namespace and not kind.namespaced):
            return None
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub and not (sub == "status" and kind.status_subresource) and (kind.plural, sub) != ("pods", "eviction"):
            return None
        return kind, namespace, name, sub

    def _authorize(self, req, verb: str, kind: Kind, resource: str, namespace: Optional[str]) -> str:
        token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if token not in self.users:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        user, admin = self.users[token]
        if admin:
            return user
        for scope, rule in self.grants.get(user, []):
            if (scope is None or scope == namespace) and kind.group in rule.get("apiGroups", []) \
                    and resource in rule.get("resources", []) and verb in rule.get("verbs", []):
                return user
        self.requests.append((user, verb, kind.group, resource, namespace, 403))
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        raise ApiError(403, "Forbidden", f'{kind.plural} is forbidden: User "{user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{kind.group}"{where}')

    def _serve(self, req, verb: str, kind: Kind, namespace: Optional[str], name: Optional[str],
               sub: Optional[str], query: dict, body: Optional[dict]) -> tuple[int, dict]:
        with self.cond:
            key = (kind.group, kind.plural, namespace or "", name or "")
            if verb == "list":
                by_name = (query.get("fieldSelector") or "").removeprefix("metadata.name=") or None
                items = [copy.deepcopy(o) for (g, p, ns, n), o in sorted(self.objects.items())
                         if (g, p) == (kind.group, kind.plural) and (namespace is None or ns == namespace)
                         and matches(o["metadata"].get("labels") or {}, query.get("labelSelector"))
                         and by_name in (None, n)]
                return 200, self.page(kind, items, query)
            if verb == "create" and sub == "eviction":
                return 201, self._evict(key)
            if verb == "create":
                return 201, self._create(kind, namespace, body)
            if key not in self.objects:
                label = f'{kind.plural}{"." + kind.group if kind.group else ""}'
                raise ApiError(404, "NotFound", f'{label} "{name}" not found')
            if verb == "get":
                return 200, copy.deepcopy(self.objects[key])
            if verb == "delete":
                wanted_uid = ((body or {}).get("preconditions") or {}).get("uid")
                if wanted_uid and wanted_uid != self.objects[key]["metadata"]["uid"]:
                    raise ApiError(409, "Conflict", f'Precondition failed: UID in precondition: {wanted_uid}, UID in '
                                                    f'object meta: {self.objects[key]["metadata"]["uid"]}')
                grace = query.get("gracePeriodSeconds", (body or {}).get("gracePeriodSeconds"))
                return 200, self._delete(key, None if grace is None else int(grace))
            old = self.objects[key]
            if verb == "update":
                if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
                    raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind.plural} "{name}": '
                                                    f"the object has been modified")
                new = {**copy.deepcopy(body), "metadata": {**body["metadata"], **{
                    k: old["metadata"][k] for k in ("uid", "creationTimestamp", "generation")}}}
            else:
                kinds = req.headers.get("Content-Type", "").split(";")[0]
                if kinds not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                    raise ApiError(415, "UnsupportedMediaType", f"the stand-in does not support {kinds} patches")
                new = merge_patch(old, body)
            if kind.status_subresource:  # the status subresource: each endpoint changes only its part
                if sub == "status":
                    new = {**copy.deepcopy(old), "status": new.get("status")}
                else:
                    new["status"] = copy.deepcopy(old.get("status"))
                    if new.get("status") is None:
                        new.pop("status")
            if new.get("spec") != old.get("spec"):
                new["metadata"] = {**new["metadata"], "generation": old["metadata"].get("generation", 1) + 1}
            if new == old:
                return 200, copy.deepcopy(old)  # a no-op: no new resourceVersion, no event
            new = self._admit(kind, new, old)
            if kind.plural == "customresourcedefinitions":
                self._register(new)
            return 200, self._store(key, new, "MODIFIED")

    def _evict(self, key: tuple) -> dict:
        """The Eviction API (`kubectl drain`): the pod gets its DisruptionTarget condition, then a graceful delete."""
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'pods "{key[3]}" not found')
        pod = copy.deepcopy(self.objects[key])
        pod.setdefault("status", {}).setdefault("conditions", []).append({
            "type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self._store(key, pod, "MODIFIED")
        self._delete(key, None)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _watch(self, req, kind: Kind, namespace: Optional[str], query: dict) -> None:
        selector = query.get("labelSelector")
        deadline = time.monotonic() + min(int(query.get("timeoutSeconds", 1800)), 1800)
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Transfer-Encoding", "chunked")
        req.end_headers()

        def wanted(key: tuple, obj: dict) -> bool:
            return key[:2] == (kind.group, kind.plural) and (namespace is None or key[2] == namespace) \
                and matches(obj["metadata"].get("labels") or {}, selector)

        def send(event: str, obj: dict) -> None:
            line = json.dumps({"type": event, "object": obj}).encode() + b"\n"
            req.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            req.wfile.flush()
        epoch = self.watch_epoch
        try:
            with self.cond:
                since = query.get("resourceVersion")
                if since in (None, "", "0"):  # "start at most recent": the current objects first
                    batch = [(self.rv, "ADDED", k, copy.deepcopy(o)) for k, o in sorted(self.objects.items())]
                    seen = self.rv
                else:
                    batch, seen = [], int(since)
            gone = False
            while True:
                for _, event, key, obj in batch:
                    if wanted(key, obj):
                        send(event, obj)
                with self.cond:
                    while not (self.log and self.log[-1][0] > seen) and seen >= self.compacted \
                            and not self.closed and time.monotonic() < deadline and self.watch_epoch == epoch:
                        self.cond.wait(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                    if seen < self.compacted:  # events after `seen` are forgotten: the client must relist
                        gone = True
                        break
                    if self.watch_epoch != epoch:  # dropped: the connection ends with no closing chunk
                        req.close_connection = True
                        return
                    if self.closed or time.monotonic() >= deadline:
                        break
                    batch = [e for e in self.log if e[0] > seen]
                    seen = batch[-1][0]
            if gone:
                send("ERROR", ApiError(410, "Expired", f"too old resource version: {since} "
                                                        f"({self.compacted})").status())
            elif query.get("allowWatchBookmarks") in ("true", "1"):  # how far this stream got, for a re-watch
                send("BOOKMARK", {"kind": kind.kind, "apiVersion": kind.api_version,
                                  "metadata": {"resourceVersion": str(seen)}})
            req.wfile.write(b"0\r\n\r\n")
            req.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        req.close_connection = True

    @staticmethod
    def _reply(req, code: int, result: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(result).encode()
        req.send_response(code)
        for header, value in (headers or {}).items():
            req.send_header(header, value)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
        req.wfile.flush()


def kubeconfig(server: str, token: str, namespace: str = "default") -> dict:
    """A kubeconfig for one user of the stand-in."""
    return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": namespace}}]}
