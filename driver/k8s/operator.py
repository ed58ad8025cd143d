"""The operator: each TrainingJob gets a driver, executor pods, a Service, a ConfigMap and a status.

Of its replicas, the one holding the Lease leads (leader.py); its writes, and its drivers', are fenced by
it, and it stops every driver when it loses it. While leading, one level-triggered loop: informers (list +
watch) cache the TrainingJobs, the operator's pods and the machines, and wake the loop on any change; each
pass reconciles every job from those caches and the job's Redis:

  1. adopt the job once: resolve its config, check its pod spec, submit it to Redis (or find it there),
     apply its Service, ConfigMap, credentials and NetworkPolicy (adoption.py, credentials.py); a job
     whose Redis record was lost is re-seeded from its status
  2. spec.paused -> the desired state in Redis: what `megascale pause` / `resume` write locally
  3. publish its pods for its driver (caches.py), and keep the driver (`jobdriver.py`, a child process)
     running until the job has ended
  4. evict nodes whose pods or machines failed, judged by the pod's own evidence (evictions.py); resume a
     job the driver paused; cordon the machines of nodes evicted for a failed self-check or a hardware
     error in a rank's log, and machines where pods of different jobs crashed (crashes.py; within
     spec.cordonBudget and the node pool)
  5. write the status (status.py)

Nothing lives only in this process: a restarted operator resumes from the statuses and Redis. A job's
pods are those whose controller ownerReference carries its UID (ownership.py), never merely its name.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from kubernetes.client.exceptions import ApiException

from .. import log
from megascale.common.processes import stop_process, stop_processes
from ..state import JobRecord
from . import adoption, crashes, credentials, evictions, gang, health, jobdriver
from . import status as job_status
from .adoption import Runtime, frozen
from .caches import trim_machine
from .informer import Informer
from .kube import Kube, reason
from .leader import Fence, LeaderElection, LeaseConfig
from .ownership import owned_by
from .spec import GROUP, JOB_LABEL, MANAGED_BY, NODE_LABEL, PLURAL, RUN_DIR, VERSION, PodPolicy, ServiceDefaults

DRIVER_RESTARTS = 5  # within RESTART_WINDOW_S; then the operator waits for the window to pass
RESTART_WINDOW_S = 60.0
RETIRE_S = 30.0  # a deleted job's driver gets this long to stop its nodes in order
FINISHED_TTL_S = 7 * 86400  # a finished job's keys stay in Redis this long, for `megascale` tools to read
POD_SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())


class Operator:
    def __init__(self, kube: Kube, namespace: Optional[str], defaults: ServiceDefaults, *,
                 kubeconfig: Optional[str] = None, tick_s: float = 1.0, status_every_s: float = 5.0,
                 checkpoint_every_s: float = 60.0, missing_grace_s: float = 30.0, driver_log: Optional[Path] = None,
                 run_dir: str = RUN_DIR, pod_policy: PodPolicy = PodPolicy(),
                 node_pool: Optional[dict[str, str]] = None, lease: Optional[LeaseConfig] = None):
        self.kube, self.namespace, self.defaults, self.kubeconfig = kube, namespace, defaults, kubeconfig
        self.run_dir = run_dir  # the ranks' run directory in every pod (and the drivers' timings store here)
        self.tick_s, self.status_every_s = tick_s, status_every_s
        self.checkpoint_every_s, self.missing_grace_s = checkpoint_every_s, missing_grace_s
        self.driver_log = driver_log
        self.pod_policy = pod_policy
        self.node_pool = node_pool or {}  # labels a machine must carry for the operator to cordon it
        self.lease = lease or LeaseConfig()
        self.workdir: Optional[Path] = None  # 0700, while running: the fence and the drivers' secrets files
        self.fence: Optional[Fence] = None  # the Lease, as the drivers check it
        self.election: Optional[LeaderElection] = None
        self.runtimes: dict[tuple[str, str], Runtime] = {}
        self.not_ready_since: dict[str, float] = {}  # machine -> when first seen NotReady (monotonic)
        self.crashes = crashes.CrashTracker()  # machine -> recent crashes of executor pods, of all jobs
        self.retiring: list[tuple[Runtime, bool]] = []  # (job, deleted)
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._said: dict[tuple, str] = {}

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Until `stop()`: leads whenever it holds the Lease. Its drivers stop when it stops leading (the jobs
        and their pods carry on without them, for the next leader's drivers)."""
        self.workdir = workdir = Path(tempfile.mkdtemp(prefix="megascale-operator-"))
        self.fence = fence = Fence(workdir / "lease")
        self.election = election = LeaderElection(self.kube.api, self.lease, fence, on_lost=self._wake.set)
        unfenced, self.kube = self.kube, self.kube.fenced(fence)
        try:
            while election.acquire(self.stopping):
                self._lead(fence)
        finally:
            election.release()
            self.kube = unfenced
            shutil.rmtree(workdir, ignore_errors=True)  # the next leader writes the secrets files again
            self.workdir = None

    def _lead(self, fence: Fence) -> None:
        """While the Lease is held (`fence`): informers, then a pass per change or tick. Then every driver stops
        and what this term learnt is dropped: the next term starts from the statuses and Redis, as a new
        operator would."""
        def wake(kind: str, obj: dict) -> None:
            self._wake.set()
        core, custom = self.kube.core, self.kube.custom
        if self.namespace:
            self.jobs = Informer("trainingjobs", custom.list_namespaced_custom_object, wake, group=GROUP,
                                 version=VERSION, namespace=self.namespace, plural=PLURAL)
            self.pods = Informer("pods", core.list_namespaced_pod, self._pod_changed, namespace=self.namespace,
                                 label_selector=POD_SELECTOR)
        else:
            self.jobs = Informer("trainingjobs", custom.list_cluster_custom_object, wake, group=GROUP,
                                 version=VERSION, plural=PLURAL)
            self.pods = Informer("pods", core.list_pod_for_all_namespaces, self._pod_changed,
                                 label_selector=POD_SELECTOR)
        # Machines post status often; their changes wait for the next tick instead of waking the loop.
        self.machines = Informer("nodes", core.list_node, lambda kind, obj: None, transform=trim_machine)
        informers = [self.jobs, self.pods, self.machines]
        for informer in informers:
            informer.start()
        try:
            for informer in informers:  # a pass before the caches fill would see every pod as gone
                while not informer.synced.wait(0.2):
                    if self.stopping.is_set() or not fence.held():
                        return
            log.info("operator watching TrainingJobs in %s", f"namespace {self.namespace}" if self.namespace
                     else "all namespaces")
            while not self.stopping.is_set() and fence.held():
                self.reconcile_all()
                self._wake.wait(self.tick_s)
                self._wake.clear()
        finally:
            for informer in informers:
                informer.stop()
            self._stop_drivers()
            for rt in [*self.runtimes.values(), *(rt for rt, _ in self.retiring)]:
                if rt.secrets_file:
                    rt.secrets_file.unlink(missing_ok=True)
            self.runtimes, self.retiring, self.not_ready_since, self._said = {}, [], {}, {}

    def _pod_changed(self, kind: str, pod: dict) -> None:
        """The pod informer's callback: every change is seen for crashes (crashes.py), then a pass."""
        self.crashes.observe(pod)
        self._wake.set()

    def stop(self) -> None:
        self.stopping.set()
        self._wake.set()

    def reconcile_all(self) -> None:
        jobs = {Informer.key(cr): cr for cr in self.jobs.snapshot()}
        pods: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
        for pod in self.pods.snapshot():
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            if JOB_LABEL in labels and NODE_LABEL in labels:
                pods[(meta["namespace"], labels[JOB_LABEL])][labels[NODE_LABEL]] = pod
        machines = {m["metadata"]["name"]: m for m in self.machines.snapshot()}
        health.track_not_ready(machines, self.not_ready_since, time.monotonic())
        for key in [k for k in self.runtimes if k not in jobs]:
            self._retire(self.runtimes.pop(key))
        self._retire_step()
        for key, cr in jobs.items():
            try:
                self.reconcile(cr, pods.get(key, {}), machines)
            except Exception as e:  # noqa: BLE001 - one job's trouble (its Redis, say) must not stop the others
                first = (str(e).strip().splitlines() or [""])[0]
                self._say(key, f"{key[0]}/{key[1]}: {type(e).__name__}: {first}", error=e)
        try:
            crashes.cordon_crashed(self, jobs, machines)
        except Exception as e:  # noqa: BLE001 - a job's Redis away: its budget is read again next pass
            self._say(("crashes",), f"cordoning machines where jobs crashed: {type(e).__name__}: {e}", error=e)

    def reconcile(self, cr: dict, pods: dict[str, dict], machines: dict[str, dict]) -> None:
        meta, spec = cr["metadata"], cr.get("spec") or {}
        key = (meta["namespace"], meta["name"])
        rt = self.runtimes.get(key)
        if rt is not None and rt.uid != meta["uid"]:  # deleted and re-created between two passes
            self._retire(self.runtimes.pop(key))
            rt = None
        pods = {node: pod for node, pod in pods.items() if owned_by(pod, meta["uid"])}  # not a predecessor's
        if rt is None:
            if (cr.get("status") or {}).get("phase") in job_status.TERMINAL_PHASES:
                return  # ended before this operator started: nothing to run
            if any((old.namespace, old.name) == key for old, _ in self.retiring):
                return  # the previous job of this name still has a driver, on the same Redis keys
            rt = adoption.adopt(self, cr)
            if rt is None:
                return
            self.runtimes[key] = rt
        requested = set(rt.store.evict_requests())  # before the record, so a request in flight is seen
        rec = rt.store.load()
        if rec is None:  # expired after the end, or lost: then start over from the status on the next pass
            if not rt.expiring:
                self._say(key, f"job {rt.job}: its record vanished from Redis; re-adopting it")
            self._retire(self.runtimes.pop(key), stop_job=False)
            return
        applied = self._apply_paused(rt, spec, rec)
        rt.pods.publish(pods)
        self._keep_driver(rt, rec)
        evictions.evict_failed(self, rt, cr, rec, pods, machines, requested)
        self._cordon(rt, spec, rec, machines)
        self._write_status(rt, cr, rec, pods, applied)

    # -- 2. pause / resume ------------------------------------------------------------------------

    def _apply_paused(self, rt: Runtime, spec: dict, rec: JobRecord) -> bool:
        """Whether the spec is applied as it stands: its live fields are read on every pass, spec.paused is
        written here; a frozen field changed (a cluster without the CRD's transition rules) is not."""
        want = bool(spec.get("paused", False))
        if not rec.terminal and want != rt.paused:
            rt.store.set_desired("paused" if want else "running")
            if rt.paused is not None:
                log.info("job %s: %s requested (spec.paused=%s)", rt.job, "pause" if want else "resume",
                         str(want).lower())
            rt.paused = want
        changed = sorted(k for k in {*rt.frozen, *frozen(spec)} if rt.frozen.get(k) != spec.get(k))
        if changed:
            self._say((rt.namespace, rt.name, "frozen"), f"job {rt.job}: not applying the change of "
                      f"{', '.join('spec.' + k for k in changed)}: frozen once submitted")
        return not changed

    # -- 3. the driver --------------------------------------------------------------------------------

    def _keep_driver(self, rt: Runtime, rec: JobRecord) -> None:
        if rt.proc is not None and rt.proc.poll() is None:
            return
        if rt.proc is not None:
            if not rec.terminal:
                log.warning("job %s: driver exited with code %s; restarting it", rt.job, rt.proc.returncode)
            rt.proc = None
        if rec.terminal and rec.cleaned:
            return
        now = time.monotonic()
        rt.starts = [t for t in rt.starts if now - t < RESTART_WINDOW_S]
        if len(rt.starts) >= DRIVER_RESTARTS:
            self._say((rt.namespace, rt.name), f"job {rt.job}: driver died {DRIVER_RESTARTS} times within "
                                               f"{RESTART_WINDOW_S:.0f} s; waiting before the next start")
            return
        rt.starts.append(now)
        # Without a log directory the driver writes to the operator's stderr: `kubectl logs` shows both.
        rt.proc = jobdriver.spawn(rt.namespace, rt.name, rt.redis_url, rt.kafka, kubeconfig=self.kubeconfig,
                                  fence=self.fence.path,
                                  service_accounts=self.pod_policy.service_accounts, secrets_file=rt.secrets_file,
                                  priority_class=self.pod_policy.priority_class,
                                  log_file=self.driver_log / f"{rt.job}.log" if self.driver_log else None)
        log.info("job %s: driver started (pid %d)", rt.job, rt.proc.pid)

    def _stop_drivers(self) -> None:
        runtimes = [*self.runtimes.values(), *(rt for rt, _ in self.retiring)]
        # SIGTERM: each driver releases its lease, so the next operator's driver takes over at once
        stop_processes([rt.proc for rt in runtimes if rt.proc], grace_s=10)

    # -- 4. evictions (evictions.py) and cordons -------------------------------------------------

    def _cordon(self, rt: Runtime, spec: dict, rec: JobRecord, machines: dict[str, dict]) -> None:
        """Cordons what `health.cordons` allows: machines of nodes evicted for a failed self-check or a hardware
        error in a rank's log, in the pool, within budget; each with a MachineCordoned Event saying why."""
        if rec.recovery is None:
            return
        pool = {**self.node_pool, **(spec.get("nodeSelector") or {})}
        now = time.time()
        todo, refused = health.cordons(rec, rt.state.host_of, rt.state.cordoned(), machines, pool,
                                       spec.get("cordonBudget", 1), now)
        for host, why_not in refused.items():
            self._say((rt.namespace, rt.name, "cordon", host), f"job {rt.job}: not cordoning {host}: {why_not}")
        for host, (node, why) in todo.items():
            try:
                self.kube.cordon(host, f"{rt.namespace}/{rt.name} evicted node {node} at "
                                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}: {why}")
            except ApiException as e:  # the job's anti-affinity keeps its own pods off the machine regardless
                self._say((rt.namespace, rt.name, "cordon", host), f"job {rt.job}: could not cordon {host}: "
                                                                   f"{reason(e)}")
                continue
            rt.state.add_cordoned(host, now)
            log.info("job %s: cordoned %s (node %s: %s)", rt.job, host, node, why)
            job = {"metadata": {"name": rt.name, "namespace": rt.namespace, "uid": rt.uid}}
            self.kube.create_event(job, "Warning", "MachineCordoned", f"cordoned {host}: node {node} evicted: {why}")

    # -- 5. status ------------------------------------------------------------------------------------

    def _write_status(self, rt: Runtime, cr: dict, rec: JobRecord, pods: dict[str, dict], applied: bool) -> None:
        meta = cr["metadata"]
        # observedGeneration: the last generation whose spec is applied in full, not merely seen
        generation = meta.get("generation") if applied else rt.status.get("observedGeneration")
        held = {"type": "EvictionHeld", "status": str(bool(rt.held)),
                "reason": "JobWideFailure" if rt.held else "NotHeld", "message": rt.held}
        valid = {"type": "Valid", "status": "True", "reason": "Submitted", "message": ""}
        created = {"type": "FailedCreateObject", "status": "False", "reason": "Created", "message": ""}  # adopted
        refused = job_status.pods_refused(rt.state.refused(), rec)
        unschedulable = gang.condition(rec, pods, rt.name)  # pods the scheduler (or Kueue) has not placed
        new = job_status.build(
            rt.status, rec, rt.store.status(), generation=generation, paused=bool(rt.paused),
            evicted_hosts=rt.state.evicted_hosts(),
            hosts={n: (p.get("spec") or {}).get("nodeName", "") for n, p in pods.items()},
            checkpoint=self._checkpoint(rt, rec), extra_conditions=[valid, created, held, refused, unschedulable],
            name=rt.name, now=time.time())
        due = not rec.terminal and time.monotonic() - rt.written >= self.status_every_s
        if job_status.changed(rt.status, new) or due:
            self.kube.patch_job_status(rt.namespace, rt.name, new)
            rt.status, rt.written = new, time.monotonic()
        if rec.terminal and rec.cleaned and not rt.expiring:
            rt.state.expire(FINISHED_TTL_S)  # the status tells the end from now on; Redis forgets it in time
            rt.expiring = True

    def _checkpoint(self, rt: Runtime, rec: JobRecord) -> Optional[dict]:
        checkpoint = rec.config.get("checkpoint") or {}
        if not checkpoint.get("uri") or time.monotonic() - rt.checkpoint_checked < self.checkpoint_every_s:
            return rt.checkpoint
        rt.checkpoint_checked = time.monotonic()
        try:
            rt.checkpoint = job_status.latest_checkpoint(checkpoint) or rt.checkpoint
        except Exception as e:  # noqa: BLE001 - storage the operator cannot read: the status says nothing new
            self._say((rt.namespace, rt.name, "checkpoint"), f"job {rt.job}: cannot list the checkpoints under "
                                                             f"{checkpoint['uri']}: {e}")
        return rt.checkpoint

    # -- deleted jobs ---------------------------------------------------------------------------------

    def _retire(self, rt: Runtime, stop_job: bool = True) -> None:
        """Lets go of a job: deleted (`stop_job`: its driver ends it; its pods go by owner reference,
        and its Redis keys after the driver), or to be adopted afresh (its driver stops now)."""
        if stop_job:
            try:
                rec = rt.store.load()
                if rec is not None and not rec.terminal:
                    rt.store.set_desired("stopped")
            except Exception as e:  # noqa: BLE001 - Redis away: the driver is stopped below regardless
                log.warning("job %s: could not ask its driver to stop: %s", rt.job, e)
            log.info("job %s: TrainingJob deleted; stopping it", rt.job)
        rt.retire_by = time.monotonic() + (RETIRE_S if stop_job else 0.0)
        self.retiring.append((rt, stop_job))

    def _retire_step(self) -> None:
        for item in list(self.retiring):
            rt, deleted = item
            running = rt.proc is not None and rt.proc.poll() is None
            if running and time.monotonic() < rt.retire_by:
                continue
            if running:
                stop_process(rt.proc, grace_s=5)
            self.retiring.remove(item)
            if rt.secrets_file:
                rt.secrets_file.unlink(missing_ok=True)
            if deleted:
                try:
                    rt.state.wipe()
                    credentials.drop_redis_user(rt.store.r, rt.job)
                except Exception as e:  # noqa: BLE001 - a new job of the name wipes the keys and replaces the user
                    log.warning("job %s: could not remove its keys and Redis user: %s", rt.job, e)

    def _say(self, key: tuple, message: str, error: Optional[BaseException] = None) -> None:
        """Logs a job's trouble once, not every pass."""
        if self._said.get(key) == message:
            return
        self._said[key] = message
        log.warning("%s", message, exc_info=None if isinstance(error, OSError) else error)  # no trace for I/O
