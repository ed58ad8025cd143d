"""A stand-in for the scheduler and the kubelets of a few machines, over a FakeApiServer: it binds
pending pods to machines and runs each pod's container as a local process.

Scheduling honours what the operator relies on: cordoned (spec.unschedulable) and NotReady
machines, nodeSelector, required node affinity (matchFields metadata.name In/NotIn, matchExpressions
on labels In/NotIn) and room (`slots` megascale pods a machine). Running a pod: its command and
args with `python` as this interpreter and volume mount paths mapped to per-pod directories (a
ConfigMap or Secret volume gets its files), its env (fieldRef status.podIP = 127.0.0.1; mount paths
mapped too) over this process's.
The pod's phase follows the process; a graceful delete sends SIGTERM, SIGKILL after the grace
period, then removes the pod. `fail_machine` kills a machine's processes and stops its kubelet, leaving its
pods Running in the API, as a machine that drops off the network looks: it is marked NotReady at once, or
after `grace_s` (default: the server's node_monitor() grace, 40 s as a real node lifecycle controller waits).
"""
from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from fake_apiserver import FakeApiServer

NOW = lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # noqa: E731


class FakeCluster:
    def __init__(self, api: FakeApiServer, machines: list[str], root: Path, slots: int = 1):
        self.api, self.machines, self.root, self.slots = api, machines, root, slots
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}  # (namespace, pod) -> process
        self.failed: set[str] = set()
        self.deleting: dict[tuple[str, str], float] = {}  # pod -> SIGKILL deadline
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)

    def start(self) -> "FakeCluster":
        for m in self.machines:
            self.api.put({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": m, "labels": {"kubernetes.io/hostname": m}},
                          "spec": {}, "status": {"conditions": [_ready(True)]}})
        self.api.on_pod_delete = self._on_delete
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            procs = list(self.procs.values())
        for proc in procs:
            _signal(proc, signal.SIGKILL)
            proc.wait()

    def fail_machine(self, name: str, grace_s: Optional[float] = None) -> None:
        self.failed.add(name)
        with self._lock:
            doomed = [p for (ns, pod), p in self.procs.items() if self._host(ns, pod) == name]
        for proc in doomed:
            _signal(proc, signal.SIGKILL)
        self.api.kubelet_stopped(name, grace_s)

    def process(self, namespace: str, pod: str) -> Optional[subprocess.Popen]:
        with self._lock:
            return self.procs.get((namespace, pod))

    # -- the loop ---------------------------------------------------------------------------

    def _host(self, namespace: str, pod: str) -> Optional[str]:
        obj = self.api.get("pods", pod, namespace)
        return obj["spec"].get("nodeName") if obj else None

    def _on_delete(self, pod: dict) -> bool:
        """A graceful delete: True if this kubelet will finish it (its machine is alive)."""
        return pod["spec"].get("nodeName") not in self.failed

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            pods = self.api.list("pods")
            self._schedule([p for p in pods if not p["spec"].get("nodeName")], pods)
            for pod in pods:
                if pod["spec"].get("nodeName") and pod["spec"]["nodeName"] not in self.failed:
                    self._sync(pod)
            live = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}
            with self._lock:  # pods force-deleted from the API: their processes go too
                orphans = [(k, p) for k, p in self.procs.items() if k not in live]
            for key, proc in orphans:
                _signal(proc, signal.SIGKILL)
                proc.wait()
                with self._lock:
                    self.procs.pop(key, None)

    def _schedule(self, pending: list[dict], pods: list[dict]) -> None:
        for pod in pending:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            used = {m: 0 for m in self.machines}
            for other in pods:
                host = other["spec"].get("nodeName")
                if host in used and (other.get("status") or {}).get("phase") in ("Pending", "Running"):
                    used[host] += 1
            machines = {n["metadata"]["name"]: n for n in self.api.list("nodes")}
            fits = [m for m in self.machines if used[m] < self.slots and self._fits(pod, machines[m])]
            if fits:
                host = min(fits, key=lambda m: (used[m], m))
                pods.append({**pod, "spec": {**pod["spec"], "nodeName": host}, "status": {"phase": "Pending"}})
                self.api.update("pods", pod["metadata"]["name"], pod["metadata"]["namespace"],
                                lambda p: p["spec"].update(nodeName=host))

    @staticmethod
    def _fits(pod: dict, machine: dict) -> bool:
        if machine["spec"].get("unschedulable") or not any(
                c["type"] == "Ready" and c["status"] == "True" for c in machine["status"]["conditions"]):
            return False
        labels = machine["metadata"].get("labels") or {}
        if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
            return False
        required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                    .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
        terms = required.get("nodeSelectorTerms")
        if not terms:
            return True

        def holds(req: dict, value: Optional[str]) -> bool:
            return (value in req["values"]) == (req["operator"] == "In")
        return any(all(holds(r, machine["metadata"]["name"]) for r in t.get("matchFields", []))
                   and all(holds(r, labels.get(r["key"])) for r in t.get("matchExpressions", [])) for t in terms)

    def _sync(self, pod: dict) -> None:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        key = (ns, name)
        with self._lock:
            proc = self.procs.get(key)
        phase = (pod.get("status") or {}).get("phase")
        if pod["metadata"].get("deletionTimestamp"):
            if proc is not None and proc.poll() is None:
                if key not in self.deleting:
                    _signal(proc, signal.SIGTERM)
                    self.deleting[key] = time.monotonic() + pod["metadata"].get("deletionGracePeriodSeconds", 30)
                elif time.monotonic() > self.deleting[key]:
                    _signal(proc, signal.SIGKILL)
                return
            self.deleting.pop(key, None)
            with self._lock:
                self.procs.pop(key, None)
            self.api.remove("pods", name, ns)
            return
        if proc is None and phase == "Pending":
            proc = self._run(pod)
            with self._lock:
                self.procs[key] = proc
            self.api.update("pods", name, ns, lambda p: p.update(status=_status(p, "Running")))
        elif proc is not None and phase == "Running" and proc.poll() is not None:
            code = proc.returncode
            _signal(proc, signal.SIGKILL)  # whatever it left behind goes with the container
            phase = "Succeeded" if code == 0 else "Failed"
            self.api.update("pods", name, ns, lambda p: p.update(status=_status(p, phase, code)))

    def _run(self, pod: dict) -> subprocess.Popen:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        home = self.root / ns / name
        mounts = {}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] == "/dev/shm":
                continue
            path = home / mount["name"]
            path.mkdir(parents=True, exist_ok=True)
            cm, secret = volumes[mount["name"]].get("configMap"), volumes[mount["name"]].get("secret")
            if cm:
                for file, text in (self.api.get("configmaps", cm["name"], ns) or {}).get("data", {}).items():
                    (path / file).write_text(text)
            if secret:
                for file, data in (self.api.get("secrets", secret["secretName"], ns) or {}).get("data", {}).items():
                    (path / file).write_bytes(base64.b64decode(data))
            mounts[mount["mountPath"]] = str(path)

        def local(arg: str) -> str:
            for inside, outside in mounts.items():
                if arg == inside or arg.startswith(inside + "/"):
                    return outside + arg[len(inside):]
            return arg
        argv = [sys.executable if a == "python" else local(a)
                for a in container.get("command", []) + container.get("args", [])]
        env = dict(os.environ)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = local(e["value"])
            elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = "127.0.0.1"
        with open(home / "container.log", "ab") as out:
            return subprocess.Popen(argv, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)


def _ready(ok: bool) -> dict:
    return {"type": "Ready", "status": "True" if ok else "Unknown",
            "reason": "KubeletReady" if ok else "NodeStatusUnknown",
            "message": "" if ok else "Kubelet stopped posting node status.", "lastTransitionTime": NOW()}


def _status(pod: dict, phase: str, code: Optional[int] = None) -> dict:
    container = pod["spec"]["containers"][0]
    state = {"running": {"startedAt": NOW()}} if code is None else {"terminated": {
        "exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": NOW()}}
    return {"phase": phase, "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "containerStatuses": [{"name": container["name"], "image": container["image"], "imageID": "",
                                   "ready": code is None, "restartCount": 0, "state": state}]}


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """SIGTERM to the container's main process, as a kubelet sends; SIGKILL to all of it (the
    executor and its ranks, one session here, one cgroup there)."""
    try:
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass
