"""Leader election for the operator: a coordination.k8s.io/v1 Lease held as client-go's leaderelection
holds one, and the fence that keeps a replica which lost it, or stalled, from writing anything.

One replica holds the Lease (holderIdentity: its pod's name and UID) and renews it every retry period;
the others try as often and take it over once they saw it go unrenewed for leaseDurationSeconds by
their own clock (clocks are never compared). A holder that could not renew within the renew deadline,
shorter than the lease duration, or that finds another holder in the Lease, has lost it: it stops its
drivers and acts no more until it wins the Lease again.

The fence is the gap between those two times. Every write of the operator and of its drivers checks
first that the last renewal is younger than the renew deadline (`Fence.check`): a deadline on the
machine's monotonic clock, in a file the operator rewrites after each renewal and its drivers (child
processes on the same machine) read. A replica that stalled past the deadline (a long pause, SIGSTOP, a
partitioned machine) wakes up to find its writes refused before any other replica can have started.
(The Kubernetes client is used directly rather than client-go's port in `kubernetes.leaderelection`:
that one has no renew deadline, no release and no hook to fence writes with.)
"""
from __future__ import annotations

import copy
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .. import log
from . import api_retry


def default_identity() -> str:
    """The pod's name and UID (downward API: POD_NAME, POD_UID); outside a pod, the hostname and a random
    UUID, as client-go's examples do: two replicas never share an identity, not even one restarted."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{os.environ.get('POD_UID') or uuid.uuid4()}"


@dataclass(frozen=True)
class LeaseConfig:
    """The Lease and its timings (client-go's leaderelection defaults: 15 / 10 / 2 s)."""
    name: str = "megascale-operator"
    namespace: str = "megascale-system"
    lease_s: int = 15  # others take the Lease over after seeing it unrenewed this long
    renew_deadline_s: float = 10.0  # the holder gives up (and its writes stop) after failing to renew this long
    retry_s: float = 2.0  # renewals and attempts to acquire, this often
    identity: str = field(default_factory=default_identity)

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError(f"lease timings: need 0 < retry ({self.retry_s:g} s) < renew deadline "
                             f"({self.renew_deadline_s:g} s) < lease duration ({self.lease_s} s)")


class NotLeader(ApiException):
    """A write refused before it left this process: the operator no longer holds its Lease. An ApiException,
    so the callers that already survive a refused call (the backend, Events) survive this one too."""

    def __init__(self, what: str):
        super().__init__(status=0, reason="NotLeader",
                         body=json.dumps({"message": f"not {what}: this operator no longer holds its Lease"}))


class Fence:
    """Until when writes are allowed: a deadline on CLOCK_MONOTONIC, which every process of the machine shares,
    kept in a file (the operator writes it, its drivers read it). No file: not allowed."""

    def __init__(self, path: Path):
        self.path = path

    def extend(self, until: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(repr(until))
        os.replace(tmp, self.path)  # a reader sees the old deadline or the new one, never half of one

    def revoke(self) -> None:
        self.path.unlink(missing_ok=True)

    def held(self) -> bool:
        try:
            return time.monotonic() < float(self.path.read_text())
        except (OSError, ValueError):
            return False

    def check(self, what: str) -> None:
        if not self.held():
            raise NotLeader(what)


def micro_time(t: float) -> str:
    """A Lease's MicroTime."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class LeaderElection:
    """`acquire()` blocks until this replica holds the Lease; a thread then renews it until it is lost
    (`lost` is set, `on_lost` called) or released."""

    def __init__(self, api: client.ApiClient, config: LeaseConfig, fence: Fence,
                 on_lost: Callable[[], None] = lambda: None):
        # Its own client, without the transport's retries: the election retries every retry period itself,
        # and one attempt must not outlast the renew deadline in backoff.
        configuration = copy.deepcopy(api.configuration)
        configuration.retries = False
        self.coordination = client.CoordinationV1Api(client.ApiClient(configuration))
        self.config, self.fence, self.on_lost = config, fence, on_lost
        self.lost = threading.Event()
        self.holder = ""  # as last read
        self._observed: tuple[Optional[str], float] = (None, 0.0)  # (resourceVersion, first seen: monotonic)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._said = ""

    @property
    def where(self) -> str:
        return f"{self.config.namespace}/{self.config.name}"

    def acquire(self, stopping: threading.Event) -> bool:
        """True once held; False when `stopping` was set first."""
        while not stopping.is_set():
            if self._try():
                log.info("operator %s holds the lease %s", self.config.identity, self.where)
                self.lost.clear()
                self._stop.clear()
                self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
                self._thread.start()
                return True
            self._tell(f"waiting for the lease {self.where}, held by {self.holder or 'nobody'}")
            stopping.wait(self.config.retry_s)
        return False

    def release(self) -> None:
        """Gives the Lease up (an orderly stop), so that another replica takes it at once, not after the lease
        duration: an empty holder and a 1 s duration, as client-go's ReleaseOnCancel writes."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        held = self.fence.held()
        self.fence.revoke()
        if not held:
            return
        try:
            lease = self._read()
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.config.identity:
                lease["spec"].update(holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time(time.time()))
                self._replace(lease)
        except api_retry.API_ERRORS as e:  # the others take it after the lease duration instead
            log.warning("could not release the lease %s: %s", self.where, api_retry.message(e))

    # -- one attempt ------------------------------------------------------------------------------------

    def _try(self) -> bool:
        """One attempt to acquire or renew; True when this replica holds the Lease, for the renew deadline
        from before the attempt (the fence is extended to then)."""
        sent = time.monotonic()
        try:
            lease = self._read()
            if lease is None:
                self._create()
                self.holder = self.config.identity
            else:
                spec = lease.setdefault("spec", {})
                version = lease["metadata"]["resourceVersion"]
                if version != self._observed[0]:
                    self._observed = (version, sent)
                self.holder = spec.get("holderIdentity") or ""
                mine = self.holder == self.config.identity
                duration = spec.get("leaseDurationSeconds") or self.config.lease_s
                if self.holder and not mine and sent - self._observed[1] < duration:
                    return False  # another's, renewed within its duration as far as this replica can tell
                now = micro_time(time.time())
                spec.update(holderIdentity=self.config.identity, leaseDurationSeconds=self.config.lease_s,
                            renewTime=now, **({} if mine else {
                                "acquireTime": now, "leaseTransitions": spec.get("leaseTransitions", 0) + 1}))
                self._replace(lease)  # with its resourceVersion: a replica that wrote in between wins
                self.holder = self.config.identity
        except api_retry.API_ERRORS as e:  # a 409: another replica's write came first
            if not (isinstance(e, ApiException) and e.status == 409):
                self._tell(f"lease {self.where}: {api_retry.message(e)}")
            return False
        self.fence.extend(sent + self.config.renew_deadline_s)
        self._said = ""
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.config.retry_s):
            renewed = self._try()
            taken = self.holder not in ("", self.config.identity)
            if taken or (not renewed and not self.fence.held()):
                self.fence.revoke()
                log.warning("operator %s lost the lease %s (%s): stopping its drivers", self.config.identity,
                            self.where, f"now held by {self.holder}" if taken else
                            f"not renewed within {self.config.renew_deadline_s:g} s")
                self.lost.set()
                self.on_lost()
                return

    def _read(self) -> Optional[dict]:
        try:
            return json.loads(self.coordination.read_namespaced_lease(
                self.config.name, self.config.namespace, _preload_content=False,
                _request_timeout=self.config.renew_deadline_s).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _create(self) -> None:
        now = micro_time(time.time())
        self.coordination.create_namespaced_lease(self.config.namespace, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.config.name, "namespace": self.config.namespace,
                         "labels": {"app.kubernetes.io/name": "megascale"}},
            "spec": {"holderIdentity": self.config.identity, "leaseDurationSeconds": self.config.lease_s,
                     "acquireTime": now, "renewTime": now, "leaseTransitions": 0}},
            _preload_content=False, _request_timeout=self.config.renew_deadline_s)

    def _replace(self, lease: dict) -> None:
        self.coordination.replace_namespaced_lease(self.config.name, self.config.namespace, lease,
                                                   _preload_content=False,
                                                   _request_timeout=self.config.renew_deadline_s)

    def _tell(self, message: str) -> None:
        if message != self._said:
            self._said = message
            log.info("%s", message)
