"""The driver: a reconcile loop that moves one job through its state machine.

Each pass loads the durable record from Redis, compares it with what the nodes report
(heartbeats) and what the user asked for (desired state, evictions), takes at most a few
idempotent steps (commands, transitions), saves the record and publishes its decisions to
`<job>.events`. Every step waits on acknowledgements recorded in Redis, never on in-memory
state, so a driver killed anywhere resumes correctly from the record.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from typing import Optional
from urllib.parse import urlparse, urlunparse

from kafka.errors import KafkaError

from megascale.config import ConfigError, JobConfig, from_dict
from megascale.messages import Event, encode, topic

from . import log
from .backend import Backend, NodeLaunch, make_backend
from .bus import ensure_topics, make_producer
from .ingest import HeartbeatIngest
from .pool import NodePool
from .recovery import Fault, RecoveryPolicy, detect_faults
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
        self.started = time.monotonic()  # no node is judged silent before it had a chance to be heard
        log.info("driver %s has job %s in state %s", self.holder, self.job, rec.state.value)
        try:
            return self._loop()
        finally:
            self.ingest.stop()
            self.events.close(timeout=2)
            self.store.release_lease(self.holder)

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
                self.store.write_status(self._status(rec))
                return 0
            self.reconcile(rec)
            self.store.save(rec)
            self.store.write_status(self._status(rec))
            if time.monotonic() >= next_offsets:
                self.store.save_offsets(*self.ingest.positions())
                next_offsets = time.monotonic() + 1.0
            time.sleep(TICK_S)
        log.info("driver stopping; job %s stays %s for the next driver", self.job, self.store.load().state.value)
        return 0

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
        if faults:
            self._fault(rec, faults[0])
        elif desired == "paused":
            self._pause(rec, "paused by user")
        elif self._all_succeeded(rec):
            step = self._progress(rec).get("step")
            self._move(rec, JobState.SUCCEEDED, f"trained to step {step}")

    def _recovering(self, rec: JobRecord, desired: str) -> None:
        fault = Fault(**rec.fault) if rec.fault else Fault("unknown", None, "unknown fault")
        if not rec.waiting_op:
            rec.waiting_op, rec.waiting_since = "stop", time.time()
        self._send_all(rec, "stop", lambda slot: {"incarnation": rec.incarnation},
                       skip=lambda slot: self._silence(slot.node) > self.cfg.control.dead_after_s)
        done, _, missing = self._acks(rec)
        timed_out = time.time() - rec.waiting_since > self.cfg.control.command_timeout_s
        silent = [s.node for s in rec.slots("active") if self._silence(s.node) > self.cfg.control.dead_after_s]
        if not done and not timed_out and set(missing) - set(silent):
            return  # live nodes still stopping their ranks
        dead = sorted(set(silent) | (set(missing) if timed_out else set()))
        for node in dead:
            slot = rec.slot(node)
            slot.dead = slot.dead or ("no heartbeat" if node in silent else "no acknowledgement")
        decision, reason = self.policy.decide(rec, fault, dead, self.cfg)
        self._event("fault", f"decision: {decision}: {reason}", rec, node=fault.node, decision=decision)
        if decision == "restart":
            rec.restarts += 0 if fault.kind == "evicted" else 1
            self._move(rec, JobState.INITIALIZING, reason)
        elif decision == "pause":
            self.store.set_desired("paused")
            self._move(rec, JobState.PAUSED, reason)
        else:
            self._move(rec, JobState.FAILED, reason)

    def _paused(self, rec: JobRecord, desired: str) -> None:
        if rec.waiting_op:
            self._send_all(rec, "stop", lambda slot: {"incarnation": rec.incarnation},
                           skip=lambda slot: self._silence(slot.node) > self.cfg.control.dead_after_s)
            done, _, _ = self._acks(rec)
            if done or time.time() - rec.waiting_since > self.cfg.control.command_timeout_s:
                rec.waiting_op, rec.waiting = "", {}
            return
        if desired != "running":
            return
        self.pool.refill_position(rec)
        dead = [s.node for s in rec.slots("active") if s.dead or self._silence(s.node) > self.cfg.control.dead_after_s]
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
        rec.fault = dataclasses.asdict(fault)
        self._event("fault", fault.message, rec, node=fault.node, kind=fault.kind, **fault.detail)
        self._move(rec, JobState.RECOVERING, fault.message)

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
        """A spare that goes silent is evicted and replaced, so the pool holds only live nodes."""
        for slot in rec.slots("spare"):
            if self._silence(slot.node) > self.cfg.control.dead_after_s and rec.state != JobState.PENDING:
                slot.dead = "no heartbeat"
                self._event("node", f"spare {slot.node} went silent: evicting it", rec, node=slot.node)
                self.pool.evict(rec, slot.node)
                self._ensure_nodes(rec)

    def _ensure_nodes(self, rec: JobRecord) -> None:
        for node in self.pool.ensure(rec):
            self._born[node] = time.monotonic()

    def _reporting(self, node: str) -> bool:
        view = self.ingest.nodes.get(node)
        return view is not None and view.hb.phase != "exiting" and self._silence(node) <= self.cfg.control.dead_after_s

    def _silence(self, node: str) -> float:
        """Seconds since the node was last heard from, counting from this driver's (or the node's) start at most."""
        view = self.ingest.nodes.get(node)
        last = max(view.received if view else 0.0, self.started, self._born.get(node, 0.0))
        return time.monotonic() - last

    def _faults(self, rec: JobRecord) -> list[Fault]:
        return detect_faults(rec, self.ingest.nodes, self._silence, self.cfg)

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
                    best = {"step": hb.step, "loss": hb.loss, "tokens_per_s": hb.tokens_per_s}
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
                errors=[f"rank {e.rank}: {e.line}" for e in hb.errors[-3:]] if hb else []))
        progress = self._progress(rec)
        return JobStatus(job=self.job, state=rec.state.value, reason=rec.reason, incarnation=rec.incarnation,
                         restarts=rec.restarts, total_steps=self.cfg.train.steps, step=progress.get("step"),
                         loss=progress.get("loss"), tokens_per_s=progress.get("tokens_per_s"), nodes=nodes,
                         driver=self.holder, updated=time.time(), heartbeats=self.ingest.processed,
                         ignored=sum(self.ingest.ignored.values()))
