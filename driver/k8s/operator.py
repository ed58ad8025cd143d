"""The operator: each TrainingJob gets a driver, executor pods, a Service, a ConfigMap and a status.

One level-triggered loop. Informers (list + watch) cache the TrainingJobs, the operator's pods and
the machines, and wake the loop on any change; each pass reconciles every job from those caches
and the job's Redis:

  1. adopt the job once: resolve its config, check its pod spec, submit it to Redis (or find it there),
     apply its Service, ConfigMap, credentials and NetworkPolicy (credentials.py); a job whose Redis
     record was lost is re-seeded from its status
  2. spec.paused -> the desired state in Redis: what `megascale pause` / `resume` write locally
  3. keep its driver (`jobdriver.py`, a child process) running until the job has ended
  4. evict nodes whose pods or machines failed, judged by the pod's own evidence (evictions.py); resume a
     job the driver paused; cordon the machines of nodes evicted for a failed self-check (within
     spec.cordonBudget and the node pool)
  5. write the status (status.py)

Nothing lives only in this process: a restarted operator resumes from the statuses and Redis. A job's
pods are those whose controller ownerReference carries its UID (ownership.py), never merely its name.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kubernetes.client.exceptions import ApiException

from megascale.checkpoint.storage import CheckpointError, StorageUnreadable, check_checkpoint_uri
from megascale.config import JobConfig, from_dict

from .. import log
from megascale.common.processes import stop_process, stop_processes
from ..state import JobRecord, JobState, JobStore
from . import credentials, evictions, health, jobdriver
from . import status as job_status
from .backend import K8sState
from .kube import Informer, Kube, reason
from .ownership import Leftover, owned_by
from .spec import (
    GROUP,
    JOB_LABEL,
    MANAGED_BY,
    NODE_LABEL,
    PLURAL,
    RUN_DIR,
    VERSION,
    PodPolicy,
    ServiceDefaults,
    SpecError,
    base_config,
    check_pod_spec,
    config_map,
    job_config,
    job_id,
    service,
    services,
)

DRIVER_RESTARTS = 5  # within RESTART_WINDOW_S; then the operator waits for the window to pass
RESTART_WINDOW_S = 60.0
RETIRE_S = 30.0  # a deleted job's driver gets this long to stop its nodes in order
FINISHED_TTL_S = 7 * 86400  # a finished job's keys stay in Redis this long, for `megascale` tools to read
POD_SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())


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

    @property
    def job(self) -> str:
        return self.store.job


class Operator:
    def __init__(self, kube: Kube, namespace: Optional[str], defaults: ServiceDefaults, *,
                 kubeconfig: Optional[str] = None, tick_s: float = 1.0, status_every_s: float = 5.0,
                 checkpoint_every_s: float = 60.0, missing_grace_s: float = 30.0, driver_log: Optional[Path] = None,
                 run_dir: str = RUN_DIR, pod_policy: PodPolicy = PodPolicy(),
                 node_pool: Optional[dict[str, str]] = None):
        self.kube, self.namespace, self.defaults, self.kubeconfig = kube, namespace, defaults, kubeconfig
        self.run_dir = run_dir  # the ranks' run directory in every pod (and the drivers' timings store here)
        self.tick_s, self.status_every_s = tick_s, status_every_s
        self.checkpoint_every_s, self.missing_grace_s = checkpoint_every_s, missing_grace_s
        self.driver_log = driver_log
        self.pod_policy = pod_policy
        self.node_pool = node_pool or {}  # labels a machine must carry for the operator to cordon it
        self.keys_dir: Optional[Path] = None  # 0700, made on first use: the drivers' secrets files
        self.runtimes: dict[tuple[str, str], Runtime] = {}
        self.not_ready_since: dict[str, float] = {}  # machine -> when first seen NotReady (monotonic)
        self.retiring: list[tuple[Runtime, bool]] = []  # (job, deleted)
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._said: dict[tuple, str] = {}

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Until `stop()`: then the drivers stop too (jobs and their pods carry on without them)."""
        def wake(kind: str, obj: dict) -> None:
            self._wake.set()
        core, custom = self.kube.core, self.kube.custom
        if self.namespace:
            self.jobs = Informer("trainingjobs", custom.list_namespaced_custom_object, wake, group=GROUP,
                                 version=VERSION, namespace=self.namespace, plural=PLURAL)
            self.pods = Informer("pods", core.list_namespaced_pod, wake, namespace=self.namespace,
                                 label_selector=POD_SELECTOR)
        else:
            self.jobs = Informer("trainingjobs", custom.list_cluster_custom_object, wake, group=GROUP,
                                 version=VERSION, plural=PLURAL)
            self.pods = Informer("pods", core.list_pod_for_all_namespaces, wake, label_selector=POD_SELECTOR)
        # Machines post status often; their changes wait for the next tick instead of waking the loop.
        self.machines = Informer("nodes", core.list_node, lambda kind, obj: None)
        informers = [self.jobs, self.pods, self.machines]
        for informer in informers:
            informer.start()
        try:
            for informer in informers:  # a pass before the caches fill would see every pod as gone
                while not informer.synced.wait(0.2):
                    if self.stopping.is_set():
                        return
            log.info("operator watching TrainingJobs in %s", f"namespace {self.namespace}" if self.namespace
                     else "all namespaces")
            while not self.stopping.is_set():
                self.reconcile_all()
                self._wake.wait(self.tick_s)
                self._wake.clear()
        finally:
            for informer in informers:
                informer.stop()
            self._stop_drivers()
            if self.keys_dir is not None:  # the next operator writes them again from the Secrets
                shutil.rmtree(self.keys_dir, ignore_errors=True)
                self.keys_dir = None

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
            rt = self._adopt(cr)
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
        self._apply_paused(rt, spec, rec)
        self._keep_driver(rt, rec)
        evictions.evict_failed(self, rt, cr, rec, pods, machines, requested)
        self._cordon(rt, spec, rec, machines)
        self._write_status(rt, cr, rec, pods)

    # -- 1. adoption ------------------------------------------------------------------------------

    def _adopt(self, cr: dict) -> Optional[Runtime]:
        meta, spec, previous = cr["metadata"], cr["spec"], cr.get("status") or {}
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        try:
            check_pod_spec(spec, self.pod_policy, lambda secret: self.kube.secret_labels(namespace, secret))
            redis_url, kafka = services(spec, self.defaults)
            store = JobStore.from_url(redis_url, job_id(namespace, name))
            state = K8sState(store.r, store.job)
            rec = store.load()
            resuming = rec is not None and state.uid() == uid
            ran = previous.get("nextNode") or previous.get("phase") not in (None, JobState.PENDING.value)
            # A job that runs already keeps the config it was submitted with, whatever became of its source.
            cfg = from_dict(rec.config) if resuming else job_config(
                cr, base_config(spec, lambda cm: self.kube.config_map_data(namespace, cm)), self.defaults, self.run_dir)
            if not resuming and not ran:
                self._check_fresh_start(store.job, cfg)
            # Before anything starts: a name taken by someone else's Service stops the job here.
            self.kube.apply_owned("ConfigMap", namespace, config_map(cr, cfg))
            self.kube.apply_owned("Service", namespace, service(cr))
            secrets_file = self._credentials(cr, store)
        except (SpecError, CheckpointError) as e:
            self._invalid(cr, str(e))
            return None
        except Leftover as e:  # the garbage collector takes it soon; adopted on a later pass
            self._say((namespace, name), f"{namespace}/{name}: {e}")
            return None
        paused = previous.get("paused")
        if resuming:
            log.info("job %s: resuming it (%s, incarnation %d)", store.job, rec.state.value, rec.incarnation)
        elif ran:
            rec, paused = self._reseed(cr, store, state, cfg.to_dict()), None
        else:
            state.wipe()  # whatever an older job of this name left
            state.set_uid(uid)
            rec, _ = store.submit(JobRecord(job=store.job, config=cfg.to_dict(), run_dir=self.run_dir))
            paused = None
            log.info("job %s: submitted (%d nodes, %d spares)", store.job, cfg.cluster.nodes, cfg.cluster.spares)
        self._said.pop((namespace, name), None)
        return Runtime(namespace, name, uid, store, state, redis_url, kafka, paused, previous,
                       checkpoint=previous.get("lastCheckpoint"), secrets_file=secrets_file)

    def _credentials(self, cr: dict, store: JobStore) -> Path:
        """Provisions the job's credentials; returns its secrets file for the driver (the HMAC key checks
        the heartbeats)."""
        job_secrets = credentials.provision(self.kube, cr, store.r, store.job)
        if self.keys_dir is None:
            self.keys_dir = Path(tempfile.mkdtemp(prefix="megascale-operator-"))
        path = self.keys_dir / f"{store.job}.secret"
        job_secrets.write(path)
        return path

    def _check_fresh_start(self, job: str, cfg: JobConfig) -> None:
        """As `megascale launch` does: a new job does not restart into another run's checkpoints. Storage
        this pod cannot list (only the executors hold its credentials or volume) is the user's to vouch for."""
        try:
            check_checkpoint_uri(cfg.checkpoint.uri, cfg.checkpoint.resume, cfg.checkpoint.filesystem,
                                 cfg.checkpoint.filesystem_options)
        except StorageUnreadable as e:
            log.warning("job %s: not checked for an earlier run's checkpoints: %s", job, e)

    def _reseed(self, cr: dict, store: JobStore, state: K8sState, config: dict) -> JobRecord:
        """The job ran (its status says so) but Redis has no record of it: start it again from what the
        status kept (incarnation, restarts, node ids, evicted machines), on new pods: the old ones'
        commands and acknowledgements went with the record."""
        meta, previous = cr["metadata"], cr["status"]
        for pod in self.kube.list_pods(meta["namespace"], f"{JOB_LABEL}={meta['name']}"):
            if owned_by(pod, meta["uid"]):  # a predecessor's go with it, by the garbage collector
                self.kube.delete_pod(meta["namespace"], pod["metadata"]["name"], uid=pod["metadata"]["uid"])
        state.wipe()
        state.set_uid(meta["uid"])
        state.add_evicted_hosts(*previous.get("evictedNodes", []))
        rec = JobRecord(job=store.job, config=config, run_dir=self.run_dir, incarnation=previous.get("incarnation", 0),
                        restarts=previous.get("restarts", 0), next_node=previous.get("nextNode", 0),
                        reason="re-seeded from the TrainingJob status: its Redis record was lost")
        store.submit(rec)
        log.warning("job %s: no record in Redis; re-seeded from its status (incarnation %d, restarts %d, "
                    "next node n%d)", store.job, rec.incarnation, rec.restarts, rec.next_node)
        return rec

    def _invalid(self, cr: dict, message: str) -> None:
        """A spec the schema let through but the operator cannot run (a missing ConfigMap, a config error):
        the job waits in Pending, saying why, until the spec or the ConfigMap is fixed."""
        meta, previous = cr["metadata"], cr.get("status") or {}
        self._say((meta["namespace"], meta["name"]), f"{meta['namespace']}/{meta['name']}: {message}")
        if previous.get("reason") == message and previous.get("observedGeneration") == meta.get("generation"):
            return
        cond = {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": message,
                "lastTransitionTime": job_status.iso(time.time())}
        others = [c for c in previous.get("conditions") or [] if c.get("type") != "Valid"]
        self.kube.patch_job_status(meta["namespace"], meta["name"], {
            "phase": previous.get("phase") or JobState.PENDING.value, "reason": message,
            "observedGeneration": meta.get("generation"), "conditions": [*others, cond]})

    # -- 2. pause / resume ------------------------------------------------------------------------

    def _apply_paused(self, rt: Runtime, spec: dict, rec: JobRecord) -> None:
        want = bool(spec.get("paused", False))
        if rec.terminal or want == rt.paused:
            return
        rt.store.set_desired("paused" if want else "running")
        if rt.paused is not None:
            log.info("job %s: %s requested (spec.paused=%s)", rt.job, "pause" if want else "resume", str(want).lower())
        rt.paused = want

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
        """Cordons what `health.cordons` allows: machines that failed a self-check, in the pool, within budget."""
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

    # -- 5. status ------------------------------------------------------------------------------------

    def _write_status(self, rt: Runtime, cr: dict, rec: JobRecord, pods: dict[str, dict]) -> None:
        meta = cr["metadata"]
        held = {"type": "EvictionHeld", "status": str(bool(rt.held)),
                "reason": "JobWideFailure" if rt.held else "NotHeld", "message": rt.held}
        valid = {"type": "Valid", "status": "True", "reason": "Submitted", "message": ""}
        refused = job_status.pods_refused(rt.state.refused(), rec)
        new = job_status.build(
            rt.status, rec, rt.store.status(), generation=meta.get("generation"), paused=bool(rt.paused),
            evicted_hosts=rt.state.evicted_hosts(),
            hosts={n: (p.get("spec") or {}).get("nodeName", "") for n, p in pods.items()},
            checkpoint=self._checkpoint(rt, rec), extra_conditions=[valid, held, refused], name=rt.name,
            now=time.time())
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
