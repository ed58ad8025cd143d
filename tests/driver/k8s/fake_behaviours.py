"""What the stand-in API server does as real clusters behave, each switchable per test (a mixin of
FakeApiServer; fake_apiserver.py holds the store and the protocol):

- `fail(verb, plural, code)`: the next requests get an error (403 quota / Pod Security refusals, 422, 429
  with Retry-After, 5xx)
- `end_pod`: a pod ends the way the kubelet and the control plane end it (OOMKilled, Evicted, preempted with
  a DisruptionTarget condition, terminated by the kubelet for a node shutdown, deleted for a NoExecute taint,
  stuck in ImagePullBackOff); `set_ready`: a machine NotReady or Ready
- `node_monitor(grace_s=40)`: a machine whose kubelet stops (`kubelet_stopped`, FakeCluster.fail_machine) stays
  Ready for the node-monitor-grace-period before the node lifecycle controller marks it (without: at once)
- `enforce_pod_security(namespace, level)`: the PodSecurity admission plugin's 403 for pods that violate the
  namespace's `baseline` or `restricted` level, in its words
- `gc = False` leaves dependents of a deleted object until `collect_garbage()`, as the real collector
  takes them some time later; `compact()` forgets the event history (watches from before it get 410 Gone)
- paginated lists (`limit` / `continue`, served from the first page's snapshot version; a continue token
  older than the last `compact()` gets 410 Expired, as an etcd compaction makes it)
- `drop_watches()`: every open watch connection breaks off mid-stream, without its closing chunk, as a
  restarted API server or a load balancer's idle timeout drops them
"""
from __future__ import annotations

import base64
import json
import threading
import time
from typing import Optional

NODE_MONITOR_GRACE_S = 40.0  # kube-controller-manager's --node-monitor-grace-period
# The DisruptionTarget reasons end_pod gives, with the pod's end: (message, phase or None, deleted after).
DISRUPTIONS = {
    "PreemptionByScheduler": ("default-scheduler: preempting to accommodate a higher priority pod", None, True),
    "TerminationByKubelet": ("Pod was terminated in response to imminent node shutdown.", "Failed", False),
    "DeletionByTaintManager": ("Taint manager: deleting due to NoExecute taint", None, True),
}
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code}


class Behaviours:
    """Needs the server's `cond`, `objects`, `faults`, `rv`, `compacted`, `log`, `update` and `_delete`."""

    watch_epoch = 0  # drop_watches() moves it on; a watch that sees it move breaks off

    def fail(self, verb: str, plural: str, code: int, times: int = 1, message: str = "",
             retry_after: Optional[int] = None) -> None:
        """The next `times` requests `verb` on `plural` are answered `code` (after authorization)."""
        reasons = {403: "Forbidden", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
                   503: "ServiceUnavailable", 504: "Timeout"}
        self.faults.append([verb, plural, code, message or f"{reasons.get(code, code)} (injected)", retry_after,
                            times])

    def _fault(self, verb: str, plural: str) -> Optional[tuple[ApiError, Optional[int]]]:
        with self.cond:
            for fault in self.faults:
                if fault[:2] == [verb, plural] and fault[5] > 0:
                    fault[5] -= 1
                    return ApiError(fault[2], {403: "Forbidden", 422: "Invalid", 429: "TooManyRequests"}.get(
                        fault[2], "InternalError"), fault[3]), fault[4]
        return None


    def end_pod(self, name: str, namespace: str, how: str) -> Optional[dict]:
        """Ends (or stalls) a pod as a real cluster would: OOMKilled, Evicted (kubelet node pressure),
        Preempted (DisruptionTarget PreemptionByScheduler, then a graceful delete), ImagePullBackOff, or
        another reason of DISRUPTIONS (TerminationByKubelet: the pod fails; DeletionByTaintManager: deleted)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        disruption = "PreemptionByScheduler" if how == "Preempted" else how

        def change(pod: dict) -> None:
            container = pod["spec"]["containers"][0]["name"]
            status = pod.setdefault("status", {})
            if how == "OOMKilled":
                status.update(phase="Failed", containerStatuses=[{"name": container, "ready": False, "restartCount": 0,
                              "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": now}}}])
            elif how == "Evicted":
                status.update(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
            elif disruption in DISRUPTIONS:
                reason = disruption
                message, phase, _ = DISRUPTIONS[reason]
                status.setdefault("conditions", []).append({
                    "type": "DisruptionTarget", "status": "True", "reason": reason, "message": message,
                    "lastTransitionTime": now})
                if phase:
                    status.update(phase=phase, reason="Terminated", message=message)
            elif how == "ImagePullBackOff":
                status.update(phase="Pending", containerStatuses=[{"name": container, "ready": False, "restartCount": 0,
                              "state": {"waiting": {"reason": "ImagePullBackOff",
                                                    "message": 'Back-off pulling image "megascale:typo"'}}}])
            else:
                raise ValueError(how)
        ended = self.update("pods", name, namespace, change)
        if ended is not None and disruption in DISRUPTIONS and DISRUPTIONS[disruption][2]:  # graceful deletes
            with self.cond:
                self._delete(("", "pods", namespace, name), None)
        return ended

    def set_ready(self, machine: str, ready: bool) -> None:
        """A machine's Ready condition, as the node lifecycle controller sets it (NotReady: Unknown)."""
        if ready:  # its kubelet is back: a NotReady still to come is not
            timer = self._monitor().pop(machine, None)
            if timer is not None:
                timer.cancel()
        self.update("nodes", machine, None, lambda n: n.setdefault("status", {}).update(conditions=[{
            "type": "Ready", "status": "True" if ready else "Unknown",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "" if ready else "Kubelet stopped posting node status.",
            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]))

    # -- the node lifecycle controller ---------------------------------------------------------------

    node_monitor_grace_s: Optional[float] = None  # None: a stopped kubelet's machine is NotReady at once

    def node_monitor(self, grace_s: float = NODE_MONITOR_GRACE_S) -> None:
        """From now on a machine whose kubelet stops is marked NotReady only `grace_s` later, as the node
        lifecycle controller does once the kubelet's status updates and Lease renewals went missing that long."""
        self.node_monitor_grace_s = grace_s

    def kubelet_stopped(self, machine: str, grace_s: Optional[float] = None) -> None:
        """The machine's kubelet stops reporting: NotReady after `grace_s` (default: node_monitor()'s, else now)."""
        grace_s = self.node_monitor_grace_s if grace_s is None else grace_s
        if not grace_s:
            self.set_ready(machine, False)
            return
        monitor = self._monitor()
        if machine in monitor:
            return

        def mark() -> None:
            if monitor.pop(machine, None) is not None and not self.closed:
                self.set_ready(machine, False)
        monitor[machine] = timer = threading.Timer(grace_s, mark)
        timer.daemon = True
        timer.start()

    def _monitor(self) -> dict[str, threading.Timer]:
        return self.__dict__.setdefault("_node_timers", {})  # machine -> its NotReady to come

    # -- admission ------------------------------------------------------------------------------------

    def enforce_pod_security(self, namespace: str, level: str = "restricted") -> None:
        """As the label pod-security.kubernetes.io/enforce=<level> on the namespace makes the PodSecurity plugin do."""
        self.__dict__.setdefault("pod_security", {})[namespace] = level

    def admit_pod(self, namespace: Optional[str], pod: dict) -> None:
        """Raises the PodSecurity plugin's 403 for a pod that violates its namespace's level (create only)."""
        level = (self.__dict__.get("pod_security") or {}).get(namespace or "")
        if level is None:
            return
        spec = pod.get("spec") or {}
        pod_sc = spec.get("securityContext") or {}
        containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        found: list[str] = []

        def bad(check: str, names: list[str], need: str, who: str = "container") -> None:
            if names:
                listed = ", ".join(f'"{n}"' for n in names)
                plural = "s" if len(names) > 1 else ""
                found.append(f"{check} ({who}{plural} {listed} must {need})")
        host = [f for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
        if host:
            found.append(f"host namespaces ({', '.join(f + '=true' for f in host)})")
        bad("privileged", [c["name"] for c in containers if (c.get("securityContext") or {}).get("privileged")],
            "not set securityContext.privileged=true")
        added = {c["name"]: set(((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or [])
                 for c in containers}
        bad("non-default capabilities", [n for n, caps in added.items() if caps - BASELINE_CAPABILITIES],
            "not include capabilities beyond the default set in securityContext.capabilities.add")
        volumes = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
        if volumes:
            found.append(f"hostPath volumes ({', '.join(volumes)})")
        if level == "restricted":
            def sc(c: dict) -> dict:
                return c.get("securityContext") or {}
            bad("allowPrivilegeEscalation != false", [c["name"] for c in containers
                                                       if sc(c).get("allowPrivilegeEscalation") is not False],
                "set securityContext.allowPrivilegeEscalation=false")
            bad("unrestricted capabilities", [c["name"] for c in containers if "ALL" not in (
                (sc(c).get("capabilities") or {}).get("drop") or []) or added[c["name"]] - {"NET_BIND_SERVICE"}],
                'set securityContext.capabilities.drop=["ALL"] and add only NET_BIND_SERVICE')
            bad("runAsNonRoot != true", [c["name"] for c in containers if not sc(c).get(
                "runAsNonRoot", pod_sc.get("runAsNonRoot"))], "set securityContext.runAsNonRoot=true",
                "pod or container")
            bad("seccompProfile", [c["name"] for c in containers if (sc(c).get("seccompProfile") or pod_sc.get(
                "seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost")],
                'set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"', "pod or container")
        if found:
            raise ApiError(403, "Forbidden", f'pods "{pod["metadata"].get("name")}" is forbidden: violates PodSecurity '
                                             f'"{level}:latest": {", ".join(found)}')

    def collect_garbage(self) -> None:
        """Deletes objects whose owners are all gone (with `gc = False`, what the collector does later)."""
        with self.cond:
            uids = {o["metadata"]["uid"] for o in self.objects.values()}
            for key, obj in list(self.objects.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and key in self.objects and not any(r.get("uid") in uids for r in refs):
                    self._delete(key, None)

    def compact(self) -> None:
        """Forgets the event history: open watches, and new ones from older resourceVersions, get 410 Gone."""
        with self.cond:
            self.rv += 1  # a list now returns a version that can be watched from
            self.compacted, self.log = self.rv, []
            self.cond.notify_all()

    # -- pages and dropped watches ----------------------------------------------------------------------

    def page(self, kind, items: list[dict], query: dict) -> dict:
        """A list answer: one page of `items` (sorted by namespace and name) after the continue token, if any."""
        version, after = self.rv, None
        if query.get("continue"):
            token = json.loads(base64.urlsafe_b64decode(query["continue"]))
            if token["rv"] < self.compacted:
                raise ApiError(410, "Expired", "The provided continue parameter is too old to display a consistent "
                                               "list result. You can start a new list without the continue "
                                               "parameter.")
            version, after = token["rv"], tuple(token["after"])
            items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > after]
        meta: dict = {"resourceVersion": str(version)}
        limit = int(query.get("limit") or 0)
        if limit and len(items) > limit:
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"rv": version, "after": [last.get("namespace", ""), last["name"]]}).encode()).decode()
        return {"apiVersion": kind.api_version, "kind": f"{kind.kind}List", "metadata": meta, "items": items}

    def drop_watches(self) -> None:
        with self.cond:
            self.watch_epoch += 1
            self.cond.notify_all()
