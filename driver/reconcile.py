"""The driver: a reconcile loop that moves one job through its state machine.

Each pass loads the durable record from Redis, compares it with what the nodes report
(heartbeats) and what the user asked for (desired state, evictions), takes at most a few
idempotent steps (commands, transitions), saves the record and publishes its decisions to
`<job>.events`. Every step waits on acknowledgements recorded in Redis, never on in-memory
state, so a driver killed anywhere resumes correctly from the record.

Faults and what to do about them (detect, localise, self-check, evict, restart, and how long it
took) are `driver/recovery/`'s; step timings, stragglers, `/metrics` and the status file are
`driver/telemetry.py`'s.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from typing import Optional
from urllib.parse import urlparse, urlunparse

from kafka.errors import KafkaError

from megascale.config import ConfigError, JobConfig, from_dict
from megascale.elastic import layout_at, resized
from megascale.common.redis_keys import drop_incarnations
from megascale.common.messages import Event, encode, topic

from . import log
from .backend import Backend, NodeLaunch, make_backend
from .bus import ensure_topics, make_producer
from .commands import Commands
from .ingest import HeartbeatIngest
from .metrics.straggler_report import describe
from .pool import NodePool
from .recovery import HangClock, Liveness, Recoverer, all_succeeded, checkpoint_waits, progress, shrink, timings
from .recovery_record import Fault
from .state import JobRecord, JobState, JobStatus, JobStore, NodeStatus, Phase
from .telemetry import Telemetry

TICK_S = 0.25
EVICTED_SHOWN = 8  # evicted nodes the status lists (the newest); `evicted` counts them all
LEASE_TTL_S = 3.0
EXIT_GRACE_S = 10.0


class Driver:
    def __init__(self, store: JobStore, redis_url: str, kafka: str, backend: Optional[Backend] = None):
        self.store, self.redis_url, self.kafka = store, redis_url, kafka
        self.job = store.job
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._backend = backend
        self._halt = False
        self.commands = Commands(store, self.event)
        self.hangs = HangClock()
        self.recoverer = Recoverer(self)
        self._resume_looked = False  # one fresh look at exited executors per resume, not one per waiting tick

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
                            heartbeat_s=self.cfg.control.heartbeat_s, env=self._node_env(),
                            network=self.cfg.cluster.network, link_gbit=self.cfg.cluster.link_gbit,
                            standby=self.cfg.control.standby_ranks, ranks_per_node=self.cfg.ranks_per_node)
        self.backend = self._backend or make_backend(self.cfg.cluster.backend, launch, self.store.r)
        self.pool = NodePool(self.backend, self.cfg)
        if not self._connect_kafka():
            return 0
        self.ingest.members = rec.node_names()
        self.ingest.start()
        self.telemetry = Telemetry(self.store, self.cfg, self.kafka, rec.run_dir)
        self.telemetry.start(self.cfg.control.prometheus_port)
        self.liveness = Liveness(self.ingest.nodes, self.backend, self.cfg)
        log.info("driver %s has job %s in state %s", self.holder, self.job, rec.state.value)
        try:
            return self._loop()
        finally:
            self.ingest.stop()
            self.telemetry.stop()
            self.events.close(timeout=2)
            self.store.release_lease(self.holder)

    def _connect_kafka(self) -> bool:
        """Topics, the events producer and the heartbeat reader; waits out a broker that is down."""
        announced = False
        while not self._halt:
            try:
                ensure_topics(self.kafka, self._topics())
                self.events = make_producer(self.kafka)
                topic_id, offsets = self.store.offsets()
                self.ingest = HeartbeatIngest(self.kafka, self.job, topic_id, offsets)
                self._topics_for = 0  # the heartbeat topic's re-creations the job's topics were re-created after
                return True
            except KafkaError as e:
                if not announced:
                    log.warning("Kafka at %s unreachable (%s); retrying", self.kafka, type(e).__name__)
                    announced = True
                self.store.acquire_lease(self.holder, LEASE_TTL_S)
                time.sleep(1.0)
        return False

    def _topics(self) -> list[str]:
        return [topic(self.job, t) for t in ("heartbeats", "metrics", "events")]

    def _topics_after_a_broker_restart(self) -> None:
        """A restarted broker (tansu keeps nothing) has only the topics its producers re-created. The events
        topic, which only this driver writes, would stay missing: every event blocked `send` for max_block_ms,
        was lost, and the producer spun on metadata (0.4 of a core, measured). Re-created when the heartbeat
        reader sees its topic re-created; a broker still down is tried again next tick."""
        seen = self.ingest.reader.recreations
        if seen != self._topics_for:
            try:
                ensure_topics(self.kafka, self._topics())
                self._topics_for = seen
            except KafkaError as e:
                log.debug("re-creating the job's topics: %s", e)

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
            self.ingest.members = rec.node_names()  # heartbeats of any other node are dropped
            self.liveness.forget_others(self.ingest.members)
            if rec.terminal:
                self._finish(rec)
                self.telemetry.consumer.drain()  # the nodes flushed their last timings on exit: store them first
                self._straggler_news(rec)  # findings from those last timings still become events
                self.telemetry.write_status(self._status(rec), to_timings=True)
                return 0
            self._topics_after_a_broker_restart()
            self._straggler_news(rec)
            self.reconcile(rec)
            self.store.save(rec)
            due = time.monotonic() >= next_offsets
            self.telemetry.write_status(self._status(rec), to_timings=due)
            if due:
                self.store.save_offsets(*self.ingest.positions())
                next_offsets = time.monotonic() + 1.0
            time.sleep(TICK_S)
        log.info("driver stopping; job %s stays %s for the next driver", self.job, self.store.load().state.value)
        return 0

    def _straggler_news(self, rec: JobRecord) -> None:
        """Straggler findings that appeared or cleared: one event each, named by node id."""
        for f, cleared in self.telemetry.stragglers.news(rec):
            message = f"straggler cleared: rank {f.rank} on {f.node_name}" if cleared else describe(f)
            self.event("node", message, rec, node=f.node_name, straggler=f.to_dict(), cleared=cleared)

    def _node_env(self) -> dict[str, str]:
        # Every local "node" shares this host's cores; an even split keeps ranks from thrashing.
        if self.cfg.cluster.backend == "local" and "OMP_NUM_THREADS" not in os.environ:
            return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.cfg.parallelism.world_size))}
        return {}

    # -- one pass ----------------------------------------------------------------------------

    def reconcile(self, rec: JobRecord) -> None:
        desired = self.store.desired()
        if desired == "stopped":
            self.move(rec, JobState.STOPPED, "stopped by user")
            return
        self.ensure_nodes(rec)
        self.recoverer.evictions(rec)
        self.recoverer.watch_spares(rec)
        handler = {JobState.PENDING: self._pending, JobState.INITIALIZING: self._initializing,
                   JobState.RUNNING: self._running, JobState.PAUSED: self._paused,
                   JobState.RECOVERING: self._recovering}[rec.state]
        handler(rec, desired)

    def _pending(self, rec: JobRecord, desired: str) -> None:
        missing = [s.node for s in rec.slots("active") if not self.liveness.reporting(s.node)]
        if not missing:
            self.move(rec, JobState.INITIALIZING, "all nodes reported")
        elif exited := self.backend.exited_before_reporting(missing):  # a bad node setting: no wait for the timeout
            self.move(rec, JobState.FAILED, exited)
        elif time.time() - rec.entered > self.cfg.control.start_timeout_s:
            # Never a partial start; a gang the scheduler never placed is no node's fault (nothing is evicted).
            unplaced = self.backend.why_not_started(missing)
            self.move(rec, JobState.FAILED, f"{unplaced} (start timeout {self.cfg.control.start_timeout_s:.0f} s)"
                      if unplaced else f"node {missing[0]} did not report within "
                      f"{self.cfg.control.start_timeout_s:.0f} s: see `megascale logs {self.job} --node {missing[0]}`")

    def _initializing(self, rec: JobRecord, desired: str) -> None:
        if rec.phase is Phase.IDLE:
            if desired == "paused":
                self._pause(rec, "paused by user")
                return
            if self.pool.missing(rec):
                self._pause(rec, f"need {self.cfg.cluster.nodes} nodes, {len(rec.slots('active'))} left and no spare")
                return
            rec.incarnation += 1
            self.commands.await_phase(rec, Phase.START)  # saved: the incarnation is taken before any node hears of it
            # Every rank of the earlier incarnations was stopped before this one: their rendezvous keys go.
            drop_incarnations(self.store.r, self.job, before=rec.incarnation)
        self.commands.send_all(rec, lambda slot: self._start_args(rec, slot.index))
        done, failed, missing = self.commands.answers(rec)
        if failed:
            node, detail = next(iter(failed.items()))
            self.recoverer.open(rec, Fault("start_failed", node, f"node {node} could not start its ranks: {detail}"))
        elif done:
            self.move(rec, JobState.RUNNING, f"incarnation {rec.incarnation} started" + shrink.describe(rec, self.cfg))
        elif faults := [f for f in self.liveness.faults(rec) if f.kind == "node_dead"]:
            self.recoverer.open(rec, faults[0])
        elif time.time() - rec.waiting_since > self.cfg.control.command_timeout_s:
            self.recoverer.open(rec, Fault("unresponsive", missing[0], f"node {missing[0]} did not acknowledge "
                                           f"start within {self.cfg.control.command_timeout_s:.0f} s"))

    def _running(self, rec: JobRecord, desired: str) -> None:
        faults = self.liveness.faults(rec)
        seen, waits = progress(rec, self.ingest.nodes), checkpoint_waits(rec, self.ingest.nodes)
        self.hangs.track(rec, seen, waits)
        if done := timings.track(rec, self.ingest.nodes, seen):
            self.event("info", timings.summary(done), rec, node=done["node"],
                       **{k: v for k, v in done.items() if k != "node"})
        hang = self.hangs.check(rec, self.cfg, seen, waits,
                                lambda message, node: self.event("info", message, rec, node=node))
        if not faults and hang:
            faults = [hang]
        if not faults and self.cfg.control.evict_stragglers and (slow := self.telemetry.stragglers.fault(rec)):
            faults = [slow]
        if not faults and (failed_check := self.recoverer.background_fault(rec)):
            faults = [failed_check]
        if faults:
            self.recoverer.open(rec, faults[0])
        elif desired == "paused":
            self._pause(rec, "paused by user")
        elif all_succeeded(rec, self.ingest.nodes, self.cfg.ranks_per_node):
            # A rank exits 0 only after train.steps; the last heartbeats may show an earlier step (a short
            # last incarnation ends between heartbeats, or its final one is still on its way).
            timings.note_progress(rec, self.cfg.train.steps, time.time())  # the steps after the last heartbeat
            self.move(rec, JobState.SUCCEEDED, f"trained to step {self.cfg.train.steps}")

    def _recovering(self, rec: JobRecord, desired: str) -> None:
        self.recoverer.step(rec)

    def _paused(self, rec: JobRecord, desired: str) -> None:
        if rec.phase is Phase.STOP:
            self.commands.send_all(rec, lambda slot: {"incarnation": rec.incarnation},
                                   skip=lambda slot: self.liveness.gone(slot.node))
            done, _, _ = self.commands.answers(rec)
            if done or time.time() - rec.waiting_since > self.cfg.control.command_timeout_s:
                rec.phase, rec.waiting = Phase.IDLE, {}
            return
        if desired != "running":
            self._resume_looked = False
            return
        if not self._resume_looked:  # an executor killed while paused, just before `resume`: not started again
            self.liveness.exited(fresh=True)  # the cached look (≤ 1 s old) could predate the kill
            self._resume_looked = True
        reason = self.recoverer.resume(rec)
        if reason is None:
            self.move(rec, JobState.INITIALIZING, "resumed")
        elif reason != rec.reason:
            rec.reason = reason
            self.event("info", reason, rec)

    def _pause(self, rec: JobRecord, reason: str) -> None:
        self.move(rec, JobState.PAUSED, reason)
        self.commands.await_phase(rec, Phase.STOP)  # `_paused` stops the ranks

    def ensure_nodes(self, rec: JobRecord) -> None:
        for node in self.pool.ensure(rec, self.store.spares()):
            self.liveness.born[node] = time.monotonic()

    def _start_args(self, rec: JobRecord, index: int) -> dict:
        rpn = self.cfg.ranks_per_node
        parsed = urlparse(self.redis_url)
        query = "&".join(filter(None, [parsed.query, f"incarnation={rec.incarnation}"]))  # keeps rediss:// options
        rendezvous = urlunparse(parsed._replace(path=f"/{self.job}", query=query))
        config = resized(rec.config, self.cfg, rec.dp)  # a shrunk job's smaller dp (control.no_spare)
        if rec.incarnation > 1 and config.get("checkpoint", {}).get("uri"):  # a restart continues from a checkpoint
            config = {**config, "checkpoint": {**config["checkpoint"], "resume": True}}
        return {"incarnation": rec.incarnation, "ranks": list(range(index * rpn, (index + 1) * rpn)),
                "world_size": layout_at(self.cfg, rec.dp).parallelism.world_size, "config": config,
                "run_dir": rec.run_dir,
                "init_method": rendezvous, "resume": rec.incarnation > 1}

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
        self.event("info", f"job {rec.state.value.lower()}; nodes stopped", rec)
        self.events.flush(timeout=2)

    # -- reporting ---------------------------------------------------------------------------

    def move(self, rec: JobRecord, state: JobState, reason: str) -> None:
        previous = rec.move(state, reason)
        if state is JobState.PAUSED:
            self._resume_looked = False
        log.info("%s -> %s: %s", previous.value, state.value, reason)
        self.store.save(rec)
        self.event("state", f"{previous.value} -> {state.value}: {reason}", rec, previous=previous.value)

    def event(self, etype: str, message: str, rec: JobRecord, node: Optional[str] = None,
              previous: Optional[str] = None, **detail) -> None:
        if etype != "command":
            log.info("event: %s", message)
        event = Event(job=self.job, type=etype, message=message, state=rec.state.value, previous=previous,  # type: ignore[arg-type]
                      node=node, detail=detail)
        try:
            self.events.send(topic(self.job, "events"), key=(node or "").encode(), value=encode(event))
        except KafkaError as e:  # the broker is away: the decision stands, only its announcement is lost
            log.warning("could not publish event (%s): %s", type(e).__name__, message)

    def _status(self, rec: JobRecord) -> JobStatus:
        nodes = []
        for slot in rec.shown_slots(EVICTED_SHOWN):
            view = self.ingest.nodes.get(slot.node)
            hb = view.hb if view else None
            states = [r.state for r in hb.ranks] if hb and hb.incarnation == rec.incarnation else []
            nodes.append(NodeStatus(
                node=slot.node, role=slot.role, dead=slot.dead,
                alive=slot.role != "evicted" and self.liveness.reporting(slot.node),
                host=hb.ip if hb else "", phase=hb.phase if hb else "", last_heartbeat=view.wall if view else None,
                ranks={s: states.count(s) for s in dict.fromkeys(states)}, step=hb.step if hb else None,
                errors=[f"rank {e.rank}: {e.line}" for e in hb.errors[-3:]] if hb else [],
                waiting=f"{hb.waiting} ({time.time() - hb.waiting_since:.0f} s)"
                if hb and hb.waiting and hb.waiting_since and hb.incarnation == rec.incarnation else ""))
        seen = progress(rec, self.ingest.nodes)
        if rec.state == JobState.SUCCEEDED:  # every rank exited 0: trained to the end, whatever the heartbeats showed
            seen["step"] = self.cfg.train.steps
        return JobStatus(job=self.job, state=rec.state.value, reason=rec.reason, incarnation=rec.incarnation,
                         restarts=rec.restarts, total_steps=self.cfg.train.steps, step=seen.get("step"),
                         loss=seen.get("loss"), tokens_per_s=seen.get("tokens_per_s"), val_step=seen.get("val_step"),
                         val_loss=seen.get("val_loss"), val_ppl=seen.get("val_ppl"), nodes=nodes,
                         driver=self.holder, updated=time.time(), heartbeats=self.ingest.processed,
                         ignored=sum(self.ingest.ignored.values()), rejected=dict(self.ingest.ignored),
                         ettr=timings.ettr(rec), recoveries=rec.recoveries, recovered=rec.recovered,
                         evicted=rec.evicted,
                         mttr_s=timings.mttr(rec), stragglers=[describe(f) for f in self.telemetry.metrics.findings],
                         prometheus=self.telemetry.prometheus_url, timings_stored=self.telemetry.consumer.stored)

