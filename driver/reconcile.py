"""The driver: a reconcile loop that moves one job through its state machine.

Each pass loads the durable record from Redis, compares it with what the nodes report
(heartbeats) and what the user asked for (desired state, evictions), takes at most a few
idempotent steps (commands, transitions), saves the record and publishes its decisions to
`<job>.events`. Every step waits on acknowledgements recorded in Redis, never on in-memory
state, so a driver killed anywhere resumes correctly from the record.

Alongside, a `MetricsConsumer` thread stores the ranks' step timings from `<job>.metrics` in
`<run_dir>/metrics` (Parquet) and feeds `JobMetrics`: straggler findings become events, status
lines and, with `control.evict_stragglers`, faults; `/metrics` serves it all to Prometheus.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse, urlunparse

from kafka.errors import KafkaError

from megascale.config import ConfigError, JobConfig, from_dict
from megascale.common.messages import Event, encode, topic
from megascale.common.flight_format import OpRecord
from megascale.parallel.flight_recorder import localize_hang

from . import log
from .backend import Backend, NodeLaunch, make_backend
from .bus import ensure_topics, make_producer
from .ingest import HeartbeatIngest
from .metrics import prometheus
from .metrics.prometheus import JobMetrics
from .metrics.store import MetricsConsumer, ParquetStore
from .metrics.stragglers import Finding, StragglerMonitor, describe
from .pool import NodePool
from .recovery import Fault, RecoveryPolicy, detect_faults, group_members, peers_of
from .state import JobRecord, JobState, JobStatus, JobStore, NodeStatus

TICK_S = 0.25
LEASE_TTL_S = 3.0
EXIT_GRACE_S = 10.0


class Driver:
    def __init__(self, store: JobStore, redis_url: str, kafka: str, backend: Optional[Backend] = None,
                 policy: Optional[RecoveryPolicy] = None):
        self.store, self.redis_url, self.kafka = store, redis_url, kafka
        self.job = store.job
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.policy = policy or RecoveryPolicy()
        self._backend = backend
        self._halt = False
        self.started = time.monotonic()
        self._born: dict[str, float] = {}  # nodes this driver started, and when
        self._last_progress: tuple[tuple, float] = ((0, None), time.time())  # (incarnation, step), when it changed
        self._step_times: list[float] = []
        self._final_step: Optional[int] = None
        self._news: list[tuple[Finding, bool]] = []  # straggler (finding, cleared) from the consumer thread
        self._news_lock = threading.Lock()
        self._timings_incarnation = 0
        self._exited_nodes: set[str] = set()
        self._announced_wait: tuple = ()  # the checkpoint wait last reported as not a hang
        self._exited_checked = 0.0
        self._shown: dict = {}  # the newest status, as plain data, for /metrics
        self.prometheus_url: Optional[str] = None

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        """Drives the job until it ends (0) or this driver is told to stop (SIGTERM: the job carries on)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_halt", True))
        rec = self.store.load()
        if rec is None:
            log.error("no job %r in Redis at %s: submit it with `megascale run`", self.job, self.redis_url)
            return 2
        try:
            self.cfg: JobConfig = from_dict(rec.config)
        except ConfigError as e:
            log.error("job %r has an invalid config: %s", self.job, e)
            return 2
        if not self._take_lease():
            return 0
        launch = NodeLaunch(job=self.job, redis_url=self.redis_url, kafka=self.kafka, run_dir=rec.run_dir,
                            heartbeat_s=self.cfg.control.heartbeat_s, env=self._node_env())
        self.backend = self._backend or make_backend(self.cfg.cluster.backend, launch, self.store.r)
        self.pool = NodePool(self.backend, self.cfg)
        if not self._connect_kafka():
            return 0
        self.ingest.start()
        self._start_metrics(rec)
        self.started = time.monotonic()  # no node is judged silent before it had a chance to be heard
        log.info("driver %s has job %s in state %s", self.holder, self.job, rec.state.value)
        try:
            return self._loop()
        finally:
            self.ingest.stop()
            self.consumer.stop(timeout=5)
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
            self.events.close(timeout=2)
            self.store.release_lease(self.holder)

    def _start_metrics(self, rec: JobRecord) -> None:
        """The timings store, the straggler monitor and (control.prometheus_port >= 0) `/metrics`."""
        self.metrics = JobMetrics(self.job, self.cfg.ranks_per_node)
        self.timings = ParquetStore(Path(rec.run_dir) / "metrics")
        self.consumer = MetricsConsumer(self.kafka, self.job, self.timings, on_records=self._on_timings)
        self.consumer.start()
        self._http = None
        port = self.cfg.control.prometheus_port
        if port >= 0:
            try:
                self._http = prometheus.serve(
                    lambda: self.metrics.render(self._shown, dropped=self.consumer.dropped_by_senders), port)
            except OSError as e:  # a taken port costs the scrape endpoint, not the job
                log.warning("cannot serve Prometheus metrics on port %d: %s", port, e.strerror or e)
                return
            host, bound = self._http.server_address[:2]
            self.prometheus_url = f"http://{host}:{bound}/metrics"
            log.info("Prometheus metrics at %s", self.prometheus_url)

    def _on_timings(self, records: list[dict]) -> None:
        """On the consumer thread: a new incarnation starts a fresh straggler window (its ranks restarted)."""
        newest = max((r.get("incarnation") or 0 for r in records), default=0)
        if newest > self._timings_incarnation:
            self._timings_incarnation = newest
            names = self.metrics.monitor.node_names
            self.metrics.monitor = StragglerMonitor(self.cfg.ranks_per_node, node_names=names)
            self.metrics.findings = []
        records = [r for r in records if (r.get("incarnation") or 0) >= self._timings_incarnation]
        new, cleared = self.metrics.observe(records)
        with self._news_lock:
            self._news += [(f, False) for f in new] + [(f, True) for f in cleared]

    def _connect_kafka(self) -> bool:
        """Topics, the events producer and the heartbeat reader; waits out a broker that is down."""
        announced = False
        while not self._halt:
            try:
                ensure_topics(self.kafka, [topic(self.job, t) for t in ("heartbeats", "metrics", "events")])
                self.events = make_producer(self.kafka)
                topic_id, offsets = self.store.offsets()
                self.ingest = HeartbeatIngest(self.kafka, self.job, topic_id, offsets)
                return True
            except KafkaError as e:
                if not announced:
                    log.warning("Kafka at %s unreachable (%s); retrying", self.kafka, type(e).__name__)
                    announced = True
                self.store.acquire_lease(self.holder, LEASE_TTL_S)
                time.sleep(1.0)
        return False

    def _take_lease(self) -> bool:
        announced = False
        while not self.store.acquire_lease(self.holder, LEASE_TTL_S):
            if self._halt:
                return False
            if not announced:
                log.info("waiting for the driver lease held by %s", self.store.lease_holder())
                announced = True
            time.sleep(0.2)
        return True

    def _loop(self) -> int:
        next_offsets = 0.0
        while not self._halt:
            if not self.store.acquire_lease(self.holder, LEASE_TTL_S):
                log.error("lost the driver lease to %s: exiting", self.store.lease_holder())
                return 1
            rec = self.store.load()
            if rec is None:
                log.error("job %r vanished from Redis (restarted without persistence?)", self.job)
                return 1
            if rec.terminal:
                self._finish(rec)
                self.consumer.drain()  # the nodes flushed their last timings on exit: store them first
                self._straggler_news(rec)  # findings from those last timings still become events
                self._write_status(rec, to_store=True)
                return 0
            self._straggler_news(rec)
            self.reconcile(rec)
            self.store.save(rec)
            due = time.monotonic() >= next_offsets
            self._write_status(rec, to_store=due)
            if due:
                self.store.save_offsets(*self.ingest.positions())
                next_offsets = time.monotonic() + 1.0
            time.sleep(TICK_S)
        log.info("driver stopping; job %s stays %s for the next driver", self.job, self.store.load().state.value)
        return 0

    def _write_status(self, rec: JobRecord, to_store: bool) -> None:
        """Redis every pass (`status`); the timings store once a second (the dashboard reads it there)."""
        status = self._status(rec)
        self.store.write_status(status)
        self._shown = dataclasses.asdict(status)
        if to_store:
            try:
                self.timings.write_status(self.job, self._shown)
            except OSError as e:
                log.warning("cannot write the dashboard's status file: %s", e)

    def _straggler_news(self, rec: JobRecord) -> None:
        """Straggler findings that appeared or cleared: one event each, named by node id."""
        names = {s.index: s.node for s in rec.slots("active")}
        self.metrics.monitor.node_names = [names.get(i, f"node{i}") for i in range(max(names, default=-1) + 1)]
        with self._news_lock:
            news, self._news = self._news, []
        for f, cleared in news:
            message = f"straggler cleared: rank {f.rank} on {f.node_name}" if cleared else describe(f)
            self._event("node", message, rec, node=f.node_name, straggler=f.to_dict(), cleared=cleared)

    def _node_env(self) -> dict[str, str]:
        # Every local "node" shares this host's cores; an even split keeps ranks from thrashing.
        if self.cfg.cluster.backend == "local" and "OMP_NUM_THREADS" not in os.environ:
            return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.cfg.parallelism.world_size))}
        return {}

    # -- one pass ----------------------------------------------------------------------------

    def reconcile(self, rec: JobRecord) -> None:
        desired = self.store.desired()
        if desired == "stopped":
            self._move(rec, JobState.STOPPED, "stopped by user")
            return
        self._ensure_nodes(rec)
        self._evictions(rec)
        self._watch_spares(rec)
        handler = {JobState.PENDING: self._pending, JobState.INITIALIZING: self._initializing,
                   JobState.RUNNING: self._running, JobState.PAUSED: self._paused,
                   JobState.RECOVERING: self._recovering}[rec.state]
        handler(rec, desired)

    def _pending(self, rec: JobRecord, desired: str) -> None:
        missing = [s.node for s in rec.slots("active") if not self._reporting(s.node)]
        if not missing:
            self._move(rec, JobState.INITIALIZING, "all nodes reported")
        elif time.time() - rec.entered > self.cfg.control.start_timeout_s:
            self._move(rec, JobState.FAILED, f"node {missing[0]} did not report within "
                       f"{self.cfg.control.start_timeout_s:.0f} s: see `megascale logs {self.job} --node {missing[0]}`")

    def _initializing(self, rec: JobRecord, desired: str) -> None:
        if not rec.waiting_op:
            if desired == "paused":
                self._pause(rec, "paused by user")
                return
            if self.pool.missing(rec):
                self._pause(rec, f"need {self.cfg.cluster.nodes} nodes, {len(rec.slots('active'))} left and no spare")
                return
            rec.incarnation += 1
            rec.waiting_op, rec.waiting_since = "start", time.time()
            self.store.save(rec)  # the incarnation is taken before any node hears of it
        self._send_all(rec, "start", lambda slot: self._start_args(rec, slot.index))
        done, failed, missing = self._acks(rec)
        if failed:
            node, detail = next(iter(failed.items()))
            self._fault(rec, Fault("start_failed", node, f"node {node} could not start its ranks: {detail}"))
        elif done:
            self._move(rec, JobState.RUNNING, f"incarnation {rec.incarnation} started")
        elif faults := [f for f in self._faults(rec) if f.kind == "node_dead"]:
            self._fault(rec, faults[0])
        elif time.time() - rec.waiting_since > self.cfg.control.command_timeout_s:
            self._fault(rec, Fault("unresponsive", missing[0], f"node {missing[0]} did not acknowledge start "
                                   f"within {self.cfg.control.command_timeout_s:.0f} s"))

    def _running(self, rec: JobRecord, desired: str) -> None:
        faults = self._faults(rec)
        self._track_progress(rec)
        hang = self._hang(rec)
        if not faults and hang:
            faults = [hang]
        if not faults and self.cfg.control.evict_stragglers:
            faults = self._straggler_faults(rec)
        if faults:
            self._fault(rec, faults[0])
        elif desired == "paused":
            self._pause(rec, "paused by user")
        elif self._all_succeeded(rec):
            # A rank exits 0 only after train.steps; a short last incarnation can end between heartbeats.
            step = self._progress(rec).get("step") or self.cfg.train.steps
            self._final_step = step
            self._move(rec, JobState.SUCCEEDED, f"trained to step {step}")

    def _recovering(self, rec: JobRecord, desired: str) -> None:
        """Localise (hangs) -> stop every rank -> self-check suspects and their peers -> decide."""
        fault = Fault(**rec.fault) if rec.fault else Fault("unknown", None, "unknown fault")
        ctl = self.cfg.control
        if not rec.waiting_op:
            rec.waiting_op, rec.waiting_since = ("flight" if fault.kind == "hang" else "stop"), time.time()
        silent = [s.node for s in rec.slots("active") if self._gone(s.node)]
        if rec.waiting_op == "flight":
            self._send_all(rec, "flight", lambda slot: {"last": 64}, skip=lambda slot: slot.node in silent)
            done, _, missing = self._acks(rec)
            if not done and time.time() - rec.waiting_since <= ctl.command_timeout_s and set(missing) - set(silent):
                return
            fault = self._localize(rec, fault)
            self._next_phase(rec, "stop")
        if rec.waiting_op == "stop":
            self._send_all(rec, "stop", lambda slot: {"incarnation": rec.incarnation},
                           skip=lambda slot: slot.node in silent)
            done, _, missing = self._acks(rec)
            timed_out = time.time() - rec.waiting_since > ctl.command_timeout_s
            if not done and not timed_out and set(missing) - set(silent):
                return  # live nodes still stopping their ranks
            for node in sorted(set(silent) | (set(missing) if timed_out else set())):
                slot = rec.slot(node)
                slot.dead = slot.dead or ("no heartbeat" if node in silent else "no acknowledgement")
            targets = self._selfcheck_targets(rec, fault)
            if not targets:
                self._decide(rec, fault)
                return
            rec.suspects, rec.bad = targets, {}
            self._event("info", f"self-check of {', '.join(targets)} ({ctl.selfcheck_checks})", rec, nodes=targets)
            self._next_phase(rec, "diagnose")
        if rec.waiting_op == "diagnose":
            self._send_all(rec, "diagnose", self._diagnose_args,
                           skip=lambda slot: slot.node not in rec.suspects or slot.node in silent or bool(slot.dead))
            done, failed, missing = self._acks(rec)
            if not done and time.time() - rec.waiting_since <= ctl.selfcheck_budget_s + ctl.command_timeout_s \
                    and set(missing) - set(silent):
                return
            for node, detail in failed.items():
                why = _selfcheck_failure(detail)
                if why is None:  # the suite itself could not run: not the node's fault, keep it
                    self._event("info", f"self-check on {node} could not run: {detail[:200]}", rec, node=node)
                    continue
                crashed = fault.kind in ("rank_failed", "rank_error") and node == fault.node
                if crashed and ctl.crashed_selfcheck == "retry" and node not in rec.rechecked:
                    rec.rechecked.append(node)
                    rec.waiting.pop(node, None)  # sent again on the next pass
                    self._event("info", f"self-check failed on {node} ({why}); checking once more", rec, node=node)
                    return
                rec.bad[node] = f"self-check failed: {why}"
            for node in missing:
                rec.slot(node).dead = rec.slot(node).dead or "no self-check result"
            for node in sorted(set(rec.suspects) - set(rec.bad) - set(missing)):
                self._event("node", f"{node} passed its self-check: kept", rec, node=node)
            self._decide(rec, fault)

    def _next_phase(self, rec: JobRecord, op: str) -> None:
        rec.waiting_op, rec.waiting, rec.waiting_since = op, {}, time.time()
        self.store.save(rec)

    def _diagnose_args(self, slot) -> dict:
        checks = [c.strip() for c in self.cfg.control.selfcheck_checks.split(",") if c.strip()]
        return {"budget_s": self.cfg.control.selfcheck_budget_s, "checks": checks,
                "ranks_per_node": self.cfg.ranks_per_node, "inject": self.store.take_injection(slot.node)}

    def _selfcheck_targets(self, rec: JobRecord, fault: Fault) -> list[str]:
        """Live suspects and the nodes sharing a communication group with them (MegaScale §4.3)."""
        ctl = self.cfg.control
        if not (ctl.auto_recover and ctl.selfcheck) or fault.kind == "evicted":
            return []
        suspects = set(rec.suspects) or ({fault.node} if fault.node else {s.node for s in rec.slots("active")})
        rpn, p = self.cfg.ranks_per_node, self.cfg.parallelism
        index = {s.index: s.node for s in rec.slots("active")}
        ranks = {r for s in rec.slots("active") if s.node in suspects
                 for r in range(s.index * rpn, (s.index + 1) * rpn)}
        peers = {index.get(r // rpn) for r in peers_of(ranks, group_members(p.tp, p.pp, p.dp))}
        return sorted(n for n in (suspects | peers) - {None}
                      if not rec.slot(n).dead and not self._gone(n))  # type: ignore[arg-type]

    def _localize(self, rec: JobRecord, fault: Fault) -> Fault:
        """Reads every rank's flight recorder (through the executors) and names the rank(s) the others wait for."""
        acks, records = self.store.acks(), {}
        for node, seq in rec.waiting.items():
            ack = acks.get(node)
            if ack is None or ack.seq != seq or not ack.ok:
                continue
            for rank, ops in json.loads(ack.detail or "{}").items():
                if isinstance(ops, list):
                    records[int(rank)] = [OpRecord(**op) for op in ops]
        p, rpn = self.cfg.parallelism, self.cfg.ranks_per_node
        report = localize_hang(records, group_members(p.tp, p.pp, p.dp))
        index = {s.index: s.node for s in rec.slots("active")}
        nodes = sorted({index[r // rpn] for r in report.suspects if r // rpn in index})
        waiting = ", ".join(f"rank {r}: {w}" for r, w in sorted(report.waiting.items())[:4])
        if nodes:
            message = f"hang localised to {', '.join(nodes)}: {report.reason}" + (f" ({waiting})" if waiting else "")
            fault = Fault("hang", nodes[0], f"{fault.message}; {message}",
                          {**fault.detail, "suspect_ranks": report.suspects})
            rec.fault = dataclasses.asdict(fault)
            if rec.recovery is not None:
                rec.recovery["node"] = nodes[0]
        else:
            message = f"hang not localised: {report.reason}; checking every node"
        rec.suspects = nodes
        self._event("fault", message, rec, node=nodes[0] if nodes else None, suspect_ranks=report.suspects,
                    suspect_nodes=nodes)
        return fault

    def _decide(self, rec: JobRecord, fault: Fault) -> None:
        dead = sorted(s.node for s in rec.slots("active") if s.dead)
        if fault.kind == "straggler" and fault.node and rec.slot(fault.node) is not None:
            rec.bad.setdefault(fault.node, "straggler")  # a passing self-check does not make it fast
        decision, reason = self.policy.decide(rec, fault, dead, self.cfg, dict(rec.bad))
        self._event("fault", f"decision: {decision}: {reason}", rec, node=fault.node, decision=decision,
                    dead=dead, failed_selfcheck=rec.bad)
        if rec.recovery is not None:
            rec.recovery["diagnosed"] = time.time()
        if decision == "restart":
            if self.cfg.control.auto_recover:
                for node in sorted(set(dead) | set(rec.bad)):
                    self._evict(rec, node, rec.bad.get(node) or f"dead ({rec.slot(node).dead})")
            rec.restarts += 0 if fault.kind == "evicted" else 1
            rec.suspects, rec.bad, rec.rechecked = [], {}, []
            if self.pool.missing(rec):
                self._move(rec, JobState.PAUSED, f"waiting for capacity: {self.pool.missing(rec)} node(s) short "
                           f"and no spare left; resumes when a spare reports (`megascale spares {self.job} 1` "
                           f"adds one; `megascale stop {self.job}` ends the job)")
            else:
                self._move(rec, JobState.INITIALIZING, reason)
        elif decision == "pause":
            self.store.set_desired("paused")
            self._move(rec, JobState.PAUSED, reason)
        else:
            self._move(rec, JobState.FAILED, reason)

    def _evict(self, rec: JobRecord, node: str, why: str) -> None:
        spare = self.pool.evict(rec, node)
        self._ensure_nodes(rec)  # a new spare takes the place of the one used
        self._event("node",
                    f"evicted {node} ({why}); " + (f"{spare.node} takes its place" if spare else "no spare left"),
                    rec, node=node, replacement=spare.node if spare else None)
        self.store.save(rec)

    def _paused(self, rec: JobRecord, desired: str) -> None:
        if rec.waiting_op:
            self._send_all(rec, "stop", lambda slot: {"incarnation": rec.incarnation},
                           skip=lambda slot: self._gone(slot.node))
            done, _, _ = self._acks(rec)
            if done or time.time() - rec.waiting_since > self.cfg.control.command_timeout_s:
                rec.waiting_op, rec.waiting = "", {}
            return
        if desired != "running":
            return
        dead = [s.node for s in rec.slots("active") if s.dead or self._gone(s.node)]
        if self.cfg.control.auto_recover:
            for node in dead:
                self._evict(rec, node, f"dead ({rec.slot(node).dead or 'no heartbeat'})")
            dead = []
        self.pool.refill_position(rec)
        if dead:
            reason = (f"cannot resume: node {dead[0]} is dead; `megascale evict {self.job} {dead[0]}` "
                      f"replaces it with a spare")
        elif self.pool.missing(rec):
            reason = f"cannot resume: {self.pool.missing(rec)} node(s) short and no spare left"
        elif not all(self._reporting(s.node) for s in rec.slots("active")):
            reason = "waiting for the replacement node to report"
        else:
            self._move(rec, JobState.INITIALIZING, "resumed")
            return
        if reason != rec.reason:
            rec.reason = reason
            self._event("info", reason, rec)

    def _pause(self, rec: JobRecord, reason: str) -> None:
        self._move(rec, JobState.PAUSED, reason)
        rec.waiting_op, rec.waiting_since = "stop", time.time()  # `_paused` stops the ranks

    def _fault(self, rec: JobRecord, fault: Fault) -> None:
        now = time.time()
        occurred = self._occurred(rec, fault, now)
        rec.recovery = {"kind": fault.kind, "node": fault.node, "occurred": occurred, "detected": now,
                        "step": self._progress(rec).get("step") or self._last_progress[0][1] or 0,
                        "incarnation": rec.incarnation}
        fault.detail = {**fault.detail, "detection_s": round(now - occurred, 2)}
        rec.suspects, rec.bad, rec.rechecked = [], {}, []
        rec.fault = dataclasses.asdict(fault)
        self._event("fault", fault.message, rec, node=fault.node, kind=fault.kind, **fault.detail)
        self._move(rec, JobState.RECOVERING, fault.message)

    # -- progress, hangs and recovery timings ---------------------------------------------

    def _track_progress(self, rec: JobRecord) -> None:
        """Moves the hang clock and finishes the timings of a recovery once training caught up."""
        progress = self._progress(rec)
        step, now = progress.get("step"), time.time()
        key = (rec.incarnation, step)
        if key != self._last_progress[0]:
            self._last_progress = (key, min(now, progress.get("seen", now)))
            if step is not None:
                self._step_times.append(now)
        elif self._waits(rec):  # ranks blocked on a checkpoint persisting: the clock restarts when it ends
            self._last_progress = (key, now)
        st = progress.get("step_time")
        if st and st > 0:
            rec.ideal_step_s = min(st, rec.ideal_step_s or st)  # the fastest step seen is the ideal one
        r = rec.recovery
        if r is None or step is None or r.get("incarnation") == rec.incarnation:
            return
        if "resumed" not in r:
            restored = [v.hb.restored_step for s in rec.slots("active") if (v := self.ingest.nodes.get(s.node))
                        and v.hb.incarnation == rec.incarnation and v.hb.restored_step is not None]
            r["resumed"], r["restored_step"] = now, min(restored) if restored else max(0, step - 1)
            # The fault's step came from the last heartbeat before it, up to an interval stale.
            r["step"] = max(r["step"], r["restored_step"])
            r["steps_lost"] = max(0, r["step"] - r["restored_step"])
        if step >= r["step"]:
            r["caught_up"] = now
            t = {k: round(v, 2) for k, v in {
                "detection_s": r["detected"] - r["occurred"],
                "diagnosis_s": r.get("diagnosed", r["detected"]) - r["detected"],
                "restart_s": r["resumed"] - r.get("diagnosed", r["detected"]), "catchup_s": now - r["resumed"],
                "total_s": now - r["occurred"]}.items()}
            done = {"kind": r["kind"], "node": r["node"], "step": r["step"], "restored_step": r["restored_step"],
                    "steps_lost": r["steps_lost"], **t}
            rec.recoveries.append(done)
            rec.recovery = None
            self._event("info", f"recovered from {done['kind']} in {t['total_s']:.1f} s "
                        f"(detect {t['detection_s']:.1f}, diagnose {t['diagnosis_s']:.1f}, "
                        f"restart {t['restart_s']:.1f}, catch up {t['catchup_s']:.1f}: "
                        f"{done['steps_lost']} steps replayed)", rec, node=r["node"],
                        **{k: v for k, v in done.items() if k != "node"})

    def _straggler_faults(self, rec: JobRecord) -> list[Fault]:
        """control.evict_stragglers: the slowest straggler's node is a fault (checked, then evicted)."""
        findings = self.metrics.findings if self._timings_incarnation == rec.incarnation else []
        if not findings:  # findings of an older incarnation name ranks that were already restarted
            return []
        f = findings[0]  # sorted slowest first
        return [Fault("straggler", f.node_name, f"{describe(f)}; evicting its node (control.evict_stragglers)",
                      {"rank": f.rank, "segment": f.segment, "dimension": f.dimension, "slowdown": f.slowdown})]

    def _hang(self, rec: JobRecord) -> Optional[Fault]:
        """Heartbeats arrive, but the step has not moved for control.hang_after_s (before the
        incarnation's first step: for control.start_timeout_s, as ranks load and restore first;
        after the last one: for control.command_timeout_s, as they commit and exit; while ranks
        wait on a checkpoint persisting: for checkpoint.persist_timeout_s)."""
        ctl = self.cfg.control
        if not ctl.hang_after_s:
            return None
        (_, step), since = self._last_progress
        if waits := self._waits(rec):
            since_wall, what, node = min(waits)
            waited = time.time() - since_wall
            if waited > self.cfg.checkpoint.persist_timeout_s:
                return Fault("hang", node, f"no training progress: ranks on {node} have waited {waited:.0f} s for "
                             f"{what} (storage stuck or too slow; checkpoint.persist_timeout_s)",
                             {"step": step, "waiting": what})
            if self._announced_wait != (rec.incarnation, what):
                self._announced_wait = (rec.incarnation, what)
                self._event("info", f"training waits for {what} on {node}: not a hang until checkpoint."
                            f"persist_timeout_s={self.cfg.checkpoint.persist_timeout_s:.0f} s", rec, node=node)
            return None
        quiet = time.time() - max(since, rec.entered)
        if step is not None and (age := self._progress(rec).get("age_s")) is not None:
            # The node's own word that the step is still the newest, so late heartbeats are not
            # taken for a hang (a node that stops reporting is dead_after_s's case).
            quiet = min(quiet, age)
        after = ctl.hang_after_s
        if step is None:
            after = max(after, ctl.start_timeout_s)
        elif step >= self.cfg.train.steps:  # the last step is done: ranks commit and exit
            after = max(after, ctl.command_timeout_s)
        if quiet <= after:
            return None
        if step is None:
            return Fault("hang", None, f"incarnation {rec.incarnation} reported no step within {quiet:.0f} s "
                         f"of starting while every node heartbeats (control.start_timeout_s)", {"step": None})
        return Fault("hang", None, f"no training progress for {quiet:.0f} s after step {step} "
                     f"while every node heartbeats", {"step": step})

    def _waits(self, rec: JobRecord) -> list[tuple[float, str, str]]:
        """(since, what, node) for every active node whose ranks this incarnation wait outside a step."""
        return [(v.hb.waiting_since or time.time(), v.hb.waiting, s.node) for s in rec.slots("active")
                if (v := self.ingest.nodes.get(s.node)) and v.hb.incarnation == rec.incarnation and v.hb.waiting]

    def _occurred(self, rec: JobRecord, fault: Fault, now: float) -> float:
        """Best estimate of when the fault happened: an injected one's own record, else the evidence."""
        chaos = self.store.last_chaos()
        if chaos and now - 300 < chaos["time"] <= now and chaos["time"] > rec.entered - 1:
            return chaos["time"]
        if fault.kind == "node_dead":
            return now - self._silence(fault.node or "")
        if fault.kind == "hang":
            return self._last_progress[1]
        if "at" in fault.detail:  # the error line's or the bad step's own time, by the node's clock
            return min(now, fault.detail["at"])
        return now  # a straggler has no moment of failure: its detection counts from the finding

    def _ettr(self, rec: JobRecord) -> Optional[float]:
        """MegaScale's effective training time ratio: iterations x ideal iteration time / wall time."""
        step = (self._progress(rec).get("step") if not rec.terminal else None) or self._final_step
        if not step or not rec.ideal_step_s:
            return None
        self._final_step = step
        return round(min(1.0, step * rec.ideal_step_s / max(1e-9, time.time() - rec.created)), 4)

    # -- nodes -------------------------------------------------------------------------------

    def _evictions(self, rec: JobRecord) -> None:
        for node in self.store.evict_requests():
            slot = rec.slot(node)
            if slot is None or slot.role == "evicted":
                self._event("info", f"evict {node}: no such node in service; ignored", rec, node=node)
                self.store.done_evict(node)
                continue
            was_active = slot.role == "active"
            spare = self.pool.evict(rec, node)
            self._ensure_nodes(rec)  # a new spare takes the place of the one used
            moved = f"; {spare.node} takes its place" if spare else ("; no spare left" if was_active else "")
            self._event("node", f"evicted {node}{moved}", rec, node=node)
            self.store.save(rec)
            self.store.done_evict(node)
            if was_active and rec.state in (JobState.INITIALIZING, JobState.RUNNING):
                self._fault(rec, Fault("evicted", node, f"node {node} evicted by user"))

    def _watch_spares(self, rec: JobRecord) -> None:
        """A spare that exits or goes silent is evicted and replaced, so the pool holds only live nodes.
        One never heard from gets control.start_timeout_s to report (a pod may wait for a machine)."""
        ctl = self.cfg.control
        for slot in rec.slots("spare"):
            heard = slot.node in self.ingest.nodes
            silent = self._silence(slot.node) > (ctl.dead_after_s if heard else ctl.start_timeout_s)
            if (silent or slot.node in self._exited()) and rec.state != JobState.PENDING:
                slot.dead = "no heartbeat" if silent else "exited"
                self._event("node", f"spare {slot.node} {'went silent' if silent else 'exited'}: evicting it", rec,
                            node=slot.node)
                self.pool.evict(rec, slot.node)
                self._ensure_nodes(rec)

    def _ensure_nodes(self, rec: JobRecord) -> None:
        for node in self.pool.ensure(rec, self.store.spares()):
            self._born[node] = time.monotonic()

    def _reporting(self, node: str) -> bool:
        view = self.ingest.nodes.get(node)
        return view is not None and view.hb.phase != "exiting" and not self._gone(node)

    def _silence(self, node: str) -> float:
        """Seconds since the node was last heard from, counting from this driver's (or the node's) start at most."""
        view = self.ingest.nodes.get(node)
        last = max(view.received if view else 0.0, self.started, self._born.get(node, 0.0))
        return time.monotonic() - last

    def _exited(self) -> set[str]:
        """Nodes whose executor the backend reports gone (a killed process, a failed or deleted pod):
        dead at once, without waiting out the heartbeat timeout. Asked every half heartbeat, at most once a second."""
        now = time.monotonic()
        if now - self._exited_checked >= min(1.0, self.cfg.control.heartbeat_s / 2):
            self._exited_checked = now
            try:
                self._exited_nodes = {n for n, info in self.backend.list().items() if not info.alive}
            except Exception as e:  # an unreachable API server: the heartbeat timeout still catches dead nodes
                log.warning("cannot list nodes (%s: %s); relying on heartbeats", type(e).__name__, e)
        return self._exited_nodes

    def _gone(self, node: str) -> bool:
        return node in self._exited() or self._silence(node) > self.cfg.control.dead_after_s

    def _faults(self, rec: JobRecord) -> list[Fault]:
        return detect_faults(rec, self.ingest.nodes, self._silence, self.cfg, self._exited())

    def _all_succeeded(self, rec: JobRecord) -> bool:
        for slot in rec.slots("active"):
            view = self.ingest.nodes.get(slot.node)
            if view is None or view.hb.incarnation != rec.incarnation:
                return False
            if len(view.hb.ranks) != self.cfg.ranks_per_node or any(r.state != "succeeded" for r in view.hb.ranks):
                return False
        return True

    # -- commands ----------------------------------------------------------------------------

    def _start_args(self, rec: JobRecord, index: int) -> dict:
        rpn = self.cfg.ranks_per_node
        parsed = urlparse(self.redis_url)
        rendezvous = urlunparse(parsed._replace(path=f"/{self.job}", query=f"incarnation={rec.incarnation}"))
        config = rec.config
        if rec.incarnation > 1 and config.get("checkpoint", {}).get("uri"):  # a restart continues from a checkpoint
            config = {**config, "checkpoint": {**config["checkpoint"], "resume": True}}
        return {"incarnation": rec.incarnation, "ranks": list(range(index * rpn, (index + 1) * rpn)),
                "world_size": self.cfg.parallelism.world_size, "config": config, "run_dir": rec.run_dir,
                "init_method": rendezvous, "resume": rec.incarnation > 1}

    def _send_all(self, rec: JobRecord, op: str, args, skip=lambda slot: False) -> None:
        """Sends `op` once to every active node not yet sent it in this state; seqs go in the record."""
        for slot in rec.slots("active"):
            if slot.node in rec.waiting or skip(slot):
                continue
            rec.waiting[slot.node] = self.store.send(slot.node, op, args(slot))
            self.store.save(rec)
            self._event("command", f"{op} -> {slot.node}", rec, node=slot.node, seq=rec.waiting[slot.node])

    def _acks(self, rec: JobRecord) -> tuple[bool, dict[str, str], list[str]]:
        """(all acknowledged, failures by node, nodes not yet acknowledged) for the awaited command."""
        acks = self.store.acks()
        active = {s.node for s in rec.slots("active")}
        failed, missing = {}, []
        for node, seq in rec.waiting.items():
            if node not in active:
                continue
            ack = acks.get(node)
            if ack is None or ack.seq < seq:
                missing.append(node)
            elif ack.seq == seq and not ack.ok:
                failed[node] = ack.detail
        waited = active & set(rec.waiting)
        return not missing and bool(waited), failed, missing

    # -- endings -----------------------------------------------------------------------------

    def _finish(self, rec: JobRecord) -> None:
        """Terminal state: tell every node to exit, then make sure they did."""
        if rec.cleaned:
            return
        nodes = [s.node for s in rec.nodes if s.role != "evicted"]
        for node in nodes:
            self.store.send(node, "exit")
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline and any(
                info.alive for n, info in self.backend.list().items() if n in nodes):
            time.sleep(0.1)
        self.backend.stop(nodes)
        rec.cleaned = True
        self.store.save(rec)
        self._event("info", f"job {rec.state.value.lower()}; nodes stopped", rec)
        self.events.flush(timeout=2)

    # -- reporting ---------------------------------------------------------------------------

    def _move(self, rec: JobRecord, state: JobState, reason: str) -> None:
        previous = rec.move(state, reason)
        log.info("%s -> %s: %s", previous.value, state.value, reason)
        self.store.save(rec)
        self._event("state", f"{previous.value} -> {state.value}: {reason}", rec, previous=previous.value)

    def _event(self, etype: str, message: str, rec: JobRecord, node: Optional[str] = None,
               previous: Optional[str] = None, **detail) -> None:
        if etype != "command":
            log.info("event: %s", message)
        event = Event(job=self.job, type=etype, message=message, state=rec.state.value, previous=previous,  # type: ignore[arg-type]
                      node=node, detail=detail)
        try:
            self.events.send(topic(self.job, "events"), key=(node or "").encode(), value=encode(event))
        except KafkaError as e:  # the broker is away: the decision stands, only its announcement is lost
            log.warning("could not publish event (%s): %s", type(e).__name__, message)

    def _progress(self, rec: JobRecord) -> dict:
        best: dict = {}
        for view in self.ingest.nodes.values():
            hb = view.hb
            if hb.incarnation == rec.incarnation and hb.step is not None and hb.step >= best.get("step", -1):
                if hb.loss is not None or "loss" not in best:
                    best = {"step": hb.step, "loss": hb.loss, "tokens_per_s": hb.tokens_per_s,
                            "step_time": hb.step_time, "age_s": hb.step_age_s,
                            "seen": view.wall - (hb.step_age_s or 0.0)}  # when the node saw it, by our clock
        return best

    def _status(self, rec: JobRecord) -> JobStatus:
        nodes = []
        for slot in rec.nodes:
            view = self.ingest.nodes.get(slot.node)
            hb = view.hb if view else None
            states = [r.state for r in hb.ranks] if hb and hb.incarnation == rec.incarnation else []
            nodes.append(NodeStatus(
                node=slot.node, role=slot.role, dead=slot.dead,
                alive=slot.role != "evicted" and self._reporting(slot.node),
                host=hb.ip if hb else "", phase=hb.phase if hb else "", last_heartbeat=view.wall if view else None,
                ranks={s: states.count(s) for s in dict.fromkeys(states)}, step=hb.step if hb else None,
                errors=[f"rank {e.rank}: {e.line}" for e in hb.errors[-3:]] if hb else [],
                waiting=f"{hb.waiting} ({time.time() - hb.waiting_since:.0f} s)"
                if hb and hb.waiting and hb.waiting_since and hb.incarnation == rec.incarnation else ""))
        progress = self._progress(rec)
        return JobStatus(job=self.job, state=rec.state.value, reason=rec.reason, incarnation=rec.incarnation,
                         restarts=rec.restarts, total_steps=self.cfg.train.steps, step=progress.get("step"),
                         loss=progress.get("loss"), tokens_per_s=progress.get("tokens_per_s"), nodes=nodes,
                         driver=self.holder, updated=time.time(), heartbeats=self.ingest.processed,
                         ignored=sum(self.ingest.ignored.values()), ettr=self._ettr(rec), recoveries=rec.recoveries,
                         mttr_s=round(sum(r["total_s"] for r in rec.recoveries) / len(rec.recoveries), 2)
                         if rec.recoveries else None,
                         stragglers=[describe(f) for f in self.metrics.findings], prometheus=self.prometheus_url,
                         timings_stored=self.consumer.stored)


def _selfcheck_failure(detail: str) -> Optional[str]:
    """The failed checks named by a diagnose ack's JSON report; None if the suite could not run at all."""
    try:
        report = json.loads(detail)
    except ValueError:
        return None
    failed = (sorted({f for n in report.get("nodes", []) for f in n.get("failed", [])})
              if isinstance(report, dict) else [])
    return ", ".join(failed) or "failed"
