"""Recovery, one reconcile pass at a time (MegaScale §4): a fault opens a recovery; in Recovering the
driver localises a hang from the flight recorders, stops every rank, self-checks the suspects and their
group peers (or, for a node-local fault, restarts at once and checks its node beside the new ranks:
selfcheck.py), and lets the policy decide. Each step waits on acknowledgements recorded in the job record
(`rec.phase`, `rec.waiting`), so a driver killed mid-recovery resumes it.

Nodes also leave service outside a recovery: evicted by the user, or a spare that died; those are here too.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from megascale.config import JobConfig
from megascale.elastic import layout_at

from .. import crashpoints
from ..commands import Commands
from ..pool import NodePool
from ..recovery_record import Fault, Recovery
from ..state import JobRecord, JobState, JobStore, NodeSlot, Phase
from . import policy, selfcheck, shrink, timings
from .detection import Liveness, silence_limit
from .hang import HangClock, progress
from .localization import localize

Answers = tuple[dict[str, str], list[str], bool]  # failures by node, nodes without an answer, out of time


class Host(Protocol):
    """What recovery asks of the reconcile loop (driver/reconcile.py)."""
    cfg: JobConfig
    store: JobStore
    pool: NodePool
    liveness: Liveness
    hangs: HangClock
    commands: Commands

    def move(self, rec: JobRecord, state: JobState, reason: str) -> None: ...

    def event(self, etype: str, message: str, rec: JobRecord, node: Optional[str] = None, **detail) -> None: ...

    def ensure_nodes(self, rec: JobRecord) -> None: ...


class Recoverer:
    def __init__(self, host: Host):
        self.host = host

    def open(self, rec: JobRecord, fault: Fault) -> None:
        """A fault found: its recovery's timeline starts, and the job moves to Recovering."""
        host = self.host
        step = progress(rec, host.liveness.views).get("step") or host.hangs.step or 0
        timeline = timings.start(rec, fault, step, host.store.last_chaos(), host.liveness.silence, host.hangs.since)
        fault.detail = {**fault.detail, "detection_s": round(timeline.detected - timeline.occurred, 2)}
        rec.recovery = Recovery(fault, timeline)
        host.event("fault", fault.message, rec, node=fault.node, kind=fault.kind, **fault.detail)
        host.move(rec, JobState.RECOVERING, fault.message)

    def step(self, rec: JobRecord) -> None:
        """Localise (hangs) -> stop every rank -> self-check suspects and their peers -> decide."""
        host, recovery = self.host, rec.recovery  # `open` set it before moving the job here
        cfg = layout_at(host.cfg, rec.dp)  # the groups and nodes of the incarnation that failed
        ctl = cfg.control
        if rec.phase is Phase.IDLE:
            host.commands.await_phase(rec, Phase.LOCALIZE if recovery.fault.kind == "hang" else Phase.STOP)
        silent = {s.node for s in rec.slots("active") if host.liveness.gone(s.node)}
        if rec.phase is Phase.LOCALIZE:
            if self._collect(rec, lambda slot: {"last": 64}, silent, ctl.command_timeout_s) is None:
                return
            message, report, nodes = localize(rec, recovery, cfg, host.store.acks())
            host.event("fault", message, rec, node=nodes[0] if nodes else None, suspect_ranks=report.suspects,
                       suspect_nodes=nodes)
            host.commands.await_phase(rec, Phase.STOP)
        if rec.phase is Phase.STOP:
            checks = selfcheck.wanted(recovery.fault, cfg)  # executors load the suite while their ranks stop
            answered = self._collect(rec, lambda slot: {"incarnation": rec.incarnation, "selfcheck": checks}, silent,
                                     ctl.command_timeout_s)
            if answered is None:
                return  # live nodes still stopping their ranks
            _, unanswered, timed_out = answered
            for node in sorted(silent | (set(unanswered) if timed_out else set())):
                slot = rec.slot(node)
                slot.dead = slot.dead or ("executor exited" if node in host.liveness.exited() else
                                          "no heartbeat" if node in silent else "no acknowledgement")
            now, recovery.later = selfcheck.plan(rec, recovery, cfg, host.liveness.gone)
            beside = (f"self-check of {', '.join(recovery.later)} beside the new ranks ({ctl.selfcheck_checks})"
                      if recovery.later else "")
            if not now:
                if beside:
                    host.event("info", f"restarting at once; {beside}", rec, nodes=recovery.later)
                self._decide(rec, recovery)
                return
            recovery.suspects = now
            for node in now:  # checked now: a background check still running there is superseded
                rec.checking.pop(node, None)
            host.event("info", f"self-check of {', '.join(now)} ({ctl.selfcheck_checks})"
                       + (f"; {beside}" if beside else ""), rec, nodes=now)
            host.commands.await_phase(rec, Phase.SELFCHECK)
        if rec.phase is Phase.SELFCHECK:
            answered = self._collect(rec, lambda slot: selfcheck.request(cfg, host.store.take_injection(slot.node)),
                                     silent, ctl.selfcheck_budget_s + ctl.command_timeout_s,
                                     skip=lambda slot: slot.node not in recovery.suspects or bool(slot.dead))
            if answered is None:
                return
            failed, unanswered, _ = answered
            if selfcheck.judge(rec, recovery, cfg, failed, unanswered, host.event):
                self._decide(rec, recovery)

    def _collect(self, rec: JobRecord, args: Callable[[NodeSlot], dict], silent: set[str], budget_s: float,
                 skip: Callable[[NodeSlot], bool] = lambda slot: False) -> Optional[Answers]:
        """Sends the phase's command to the live nodes; its answers once all of them answered or `budget_s`
        passed, None while waiting."""
        commands = self.host.commands
        commands.send_all(rec, args, skip=lambda slot: slot.node in silent or skip(slot))
        done, failed, unanswered = commands.answers(rec)
        timed_out = time.time() - rec.waiting_since > budget_s
        if not done and not timed_out and set(unanswered) - silent:
            return None
        return failed, unanswered, timed_out

    def _decide(self, rec: JobRecord, recovery: Recovery) -> None:
        """`recovery.later`: the nodes to self-check beside the restarted ranks (those still in service)."""
        host, fault = self.host, recovery.fault
        dead = sorted(s.node for s in rec.slots("active") if s.dead)
        if fault.kind == "straggler" and fault.node and rec.slot(fault.node) is not None:
            recovery.bad.setdefault(fault.node, "straggler")  # a passing self-check does not make it fast
        if fault.kind == "selfcheck_failed" and fault.node:
            recovery.bad.setdefault(fault.node, fault.detail["why"])  # checked already, beside the ranks
        if selfcheck.hardware(fault) and fault.node and host.cfg.control.auto_recover:
            recovery.bad.setdefault(fault.node, fault.detail["why"])  # its log names its machine bad: no check
        decision, reason = policy.decide(rec, recovery, dead, host.cfg)
        host.event("fault", f"decision: {decision}: {reason}", rec, node=fault.node, decision=decision,
                   dead=dead, failed_selfcheck=recovery.bad)
        if recovery.timeline is not None:
            recovery.timeline.diagnosed = time.time()
        if decision == "restart":
            for node, why in policy.evictions(rec, recovery, dead, host.cfg).items():
                self.evict(rec, node, why)
            rec.restarts += 0 if fault.kind in ("evicted", "selfcheck_failed") else 1
            self._place(rec)
            selfcheck.send_later(rec, recovery, host.cfg, host.store)
            if short := host.pool.missing(rec):
                shrinks = " and no smaller dp fits" if host.cfg.control.no_spare == "shrink" else ""
                host.move(rec, JobState.PAUSED, f"waiting for capacity: {short} node(s) short and no spare left"
                          f"{shrinks}; resumes when a spare reports (`megascale spares {rec.job} 1` adds one; "
                          f"`megascale stop {rec.job}` ends the job)")
            else:
                host.move(rec, JobState.INITIALIZING, reason + shrink.describe(rec, host.cfg))
        elif decision == "pause":
            host.store.set_desired("paused")
            host.move(rec, JobState.PAUSED, reason)
        else:
            host.move(rec, JobState.FAILED, reason)

    def background_fault(self, rec: JobRecord) -> Optional[Fault]:
        """A node whose self-check beside the ranks failed, as a fault to recover from (selfcheck.py)."""
        return selfcheck.background_fault(rec, self.host.cfg, self.host.store, self.host.event)

    def evict(self, rec: JobRecord, node: str, why: str) -> None:
        """Takes `node` out of service for good; a spare takes its place if one is left."""
        host = self.host
        spare = host.pool.evict(rec, node)
        host.ensure_nodes(rec)  # a new spare takes the place of the one used
        host.event("node", f"evicted {node} ({why}); " + (f"{spare.node} takes its place" if spare else
                                                          "no spare left"),
                   rec, node=node, replacement=spare.node if spare else None)
        host.store.save(rec)
        crashpoints.reach(host.store, "evict")

    def resume(self, rec: JobRecord) -> Optional[str]:
        """Why a paused job cannot resume yet, or None. Under control.auto_recover its dead nodes are
        evicted for spares first; a position left unfilled takes a spare that has appeared since."""
        host = self.host
        dead = [s.node for s in rec.slots("active") if s.dead or host.liveness.gone(s.node)]
        if host.cfg.control.auto_recover:
            for node in dead:
                self.evict(rec, node, f"dead ({rec.slot(node).dead or 'no heartbeat'})")
            dead = []
        if dead:
            return (f"cannot resume: node {dead[0]} is dead; `megascale evict {rec.job} {dead[0]}` "
                    f"replaces it with a spare")
        self._place(rec)
        if host.pool.missing(rec):
            return f"cannot resume: {host.pool.missing(rec)} node(s) short and no spare left"
        if not all(host.liveness.reporting(s.node) for s in rec.slots("active")):
            return "waiting for the replacement node to report"
        return None

    def _place(self, rec: JobRecord) -> None:
        """The next incarnation's dp and nodes (control.no_spare); a change of dp is an event."""
        if change := shrink.place(rec, self.host.cfg, self.host.pool):
            self.host.event("node", change, rec, dp=rec.dp or self.host.cfg.parallelism.dp)

    def evictions(self, rec: JobRecord) -> None:
        """`megascale evict` requests; evicting an active node while ranks run is a fault."""
        host = self.host
        for node in host.store.evict_requests():
            slot = rec.slot(node)
            if slot is None or slot.role == "evicted":
                host.event("info", f"evict {node}: no such node in service; ignored", rec, node=node)
                host.store.done_evict(node)
                continue
            was_active = slot.role == "active"
            spare = host.pool.evict(rec, node)
            host.ensure_nodes(rec)  # a new spare takes the place of the one used
            moved = f"; {spare.node} takes its place" if spare else ("; no spare left" if was_active else "")
            host.event("node", f"evicted {node}{moved}", rec, node=node)
            host.store.save(rec)
            host.store.done_evict(node)
            if was_active and rec.state in (JobState.INITIALIZING, JobState.RUNNING):
                self.open(rec, Fault("evicted", node, f"node {node} evicted by user"))

    def watch_spares(self, rec: JobRecord) -> None:
        """A spare that exits or goes silent is evicted and replaced, so the pool holds only live nodes.
        One never heard from gets control.start_timeout_s to report (a pod may wait for a machine)."""
        host = self.host
        for slot in rec.slots("spare"):
            silent = host.liveness.silence(slot.node) > silence_limit(slot.node, host.liveness.views, host.cfg)
            if (silent or slot.node in host.liveness.exited()) and rec.state != JobState.PENDING:
                slot.dead = "no heartbeat" if silent else "exited"
                host.event("node", f"spare {slot.node} {'went silent' if silent else 'exited'}: evicting it", rec,
                           node=slot.node)
                host.pool.evict(rec, slot.node)
                host.ensure_nodes(rec)
