"""Fault detection (MegaScale §4.1): faults (and success) from the nodes' heartbeats, which nodes are
alive, and stragglers. A hang (heartbeats, but no progress) is `hang.py`'s: it needs a clock, not one heartbeat.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable, Optional

from megascale.config import JobConfig

from .. import log
from ..backend import Backend
from ..ingest import NodeView
from ..metrics.prometheus import JobMetrics
from ..metrics.straggler_report import describe
from ..metrics.stragglers import Finding, StragglerMonitor
from ..recovery_record import Fault
from ..state import JobRecord
from .policy import straggler_to_evict
from .selfcheck import HARDWARE_ERROR, hardware

# Error lines that mean the rank is broken even before it exits (a hung NCCL watchdog may never exit).
FATAL_ERRORS = {"hardware_error", "nccl_timeout", "cuda_error", "oom"}
ALL_SILENT_FACTOR = 3  # x control.dead_after_s: how long a node may be silent while every node is (a broker restart)


def detect_faults(rec: JobRecord, views: dict[str, NodeView], silence: Callable[[str], float],
                  cfg: JobConfig, exited: frozenset[str] | set[str] = frozenset()) -> list[Fault]:
    """Faults among the active nodes of the current incarnation, most serious first: a hardware error in a
    rank's log before the rest (its peers' failures are its doing).

    `exited`: nodes whose executor the backend saw end (a process, a pod), dead before their heartbeats lapse.
    """
    faults = []
    for slot in rec.slots("active"):
        if slot.node in exited:
            faults.append(Fault("node_dead", slot.node, f"node {slot.node}: its executor exited"))
            continue
        quiet = silence(slot.node)
        if quiet > silence_limit(slot.node, views, cfg):
            faults.append(Fault("node_dead", slot.node, f"node {slot.node}: no heartbeat for {quiet:.1f} s"))
            continue
        view = views.get(slot.node)
        if view is None or view.hb.incarnation != rec.incarnation:
            continue
        hb = view.hb
        broken = next((e for e in hb.errors if e.kind == "hardware_error"), None)
        if broken is not None:  # before its rank's exit: the line names the machine, the exit code does not
            faults.append(Fault("rank_error", slot.node, f"rank {broken.rank} on {slot.node} logged a hardware "
                                f"error: {broken.line[:160]}",
                                {"rank": broken.rank, "error": broken.kind, "at": broken.time,
                                 "why": f"{HARDWARE_ERROR}: rank {broken.rank}: {broken.line[:200]}"}))
            continue
        for r in hb.ranks:
            if r.state == "failed":
                errors = [e.line for e in hb.errors if e.rank == r.rank]
                why = f": {errors[-1]}" if errors else ""
                how = f"exited with code {r.exit_code}" if r.exit_code is not None else "failed (its process waits)"
                faults.append(Fault("rank_failed", slot.node, f"rank {r.rank} on {slot.node} {how}{why}",
                                    {"rank": r.rank, "exit_code": r.exit_code}))
                break
            if r.state == "stopped":
                faults.append(Fault("ranks_stopped", slot.node, f"rank {r.rank} on {slot.node} was stopped "
                                    f"outside the driver's control", {"rank": r.rank}))
                break
        else:
            fatal = next((e for e in hb.errors if e.kind in FATAL_ERRORS), None)
            if fatal is not None:
                faults.append(Fault("rank_error", slot.node, f"rank {fatal.rank} on {slot.node} logged "
                                    f"{fatal.kind}: {fatal.line[:160]}",
                                    {"rank": fatal.rank, "error": fatal.kind, "at": fatal.time}))
            elif hb.loss is not None and not math.isfinite(hb.loss):
                faults.append(Fault("nan_loss", slot.node, f"loss is {hb.loss} at step {hb.step} on {slot.node}",
                                    {"step": hb.step, "at": hb.time}))
    return sorted(faults, key=lambda f: not hardware(f))


def silence_limit(node: str, views: dict[str, NodeView], cfg: JobConfig) -> float:
    """How long `node` may stay silent: control.dead_after_s once heard from; a node never heard from (a spare
    just put in a dead node's place, still importing torch) gets control.start_timeout_s to report."""
    ctl = cfg.control
    return ctl.dead_after_s if node in views else max(ctl.dead_after_s, ctl.start_timeout_s)


def all_succeeded(rec: JobRecord, views: dict[str, NodeView], ranks_per_node: int) -> bool:
    """Every rank of the incarnation exited 0 (a rank does so only after train.steps)."""
    for slot in rec.slots("active"):
        view = views.get(slot.node)
        if view is None or view.hb.incarnation != rec.incarnation:
            return False
        if len(view.hb.ranks) != ranks_per_node or any(r.state != "succeeded" for r in view.hb.ranks):
            return False
    return True


class Liveness:
    """Which nodes are alive: heard from within control.dead_after_s, and not seen gone by the backend."""

    def __init__(self, views: dict[str, NodeView], backend: Backend, cfg: JobConfig):
        self.views, self.backend, self.cfg = views, backend, cfg
        self.started = time.monotonic()  # no node is judged silent before it had a chance to be heard
        self.born: dict[str, float] = {}  # nodes this driver started, and when
        self._exited: set[str] = set()
        self._checked = 0.0

    def forget_others(self, nodes: frozenset[str]) -> None:
        """Drops what it knows of nodes outside `nodes` (those the record no longer keeps: long evicted)."""
        for node in [n for n in list(self.views) if n not in nodes]:
            self.views.pop(node, None)
        for node in [n for n in self.born if n not in nodes]:
            del self.born[node]

    def silence(self, node: str) -> float:
        """Seconds since the node was last heard from, counting from this driver's (or the node's) start at most."""
        view = self.views.get(node)
        last = max(view.received if view else 0.0, self.started, self.born.get(node, 0.0))
        return time.monotonic() - last

    def exited(self, fresh: bool = False) -> set[str]:
        """Nodes whose executor the backend reports gone (a killed process, a failed or deleted pod):
        dead at once, without waiting out the heartbeat timeout. Asked every half heartbeat, at most once a second;
        `fresh` asks now (a decision that must not rest on a look from before the latest kill)."""
        now = time.monotonic()
        if fresh or now - self._checked >= min(1.0, self.cfg.control.heartbeat_s / 2):
            self._checked = now
            try:
                self._exited = {n for n, info in self.backend.list().items() if not info.alive}
            except Exception as e:  # an unreachable API server: the heartbeat timeout still catches dead nodes
                log.warning("cannot list nodes (%s: %s); relying on heartbeats", type(e).__name__, e)
        return self._exited

    def gone(self, node: str) -> bool:
        if node in self.exited():
            return True
        silent, limit = self.silence(node), silence_limit(node, self.views, self.cfg)
        if silent <= limit:  # the common case: no look at every other node (gone() runs per node, per tick)
            return False
        # The broker, or the way to it, is down likelier than every node at once.
        return not self.nobody_heard() or silent > max(limit, ALL_SILENT_FACTOR * self.cfg.control.dead_after_s)

    def nobody_heard(self) -> bool:
        """No node heard from within control.dead_after_s."""
        return bool(self.views) and all(self.silence(node) > self.cfg.control.dead_after_s for node in self.views)

    def reporting(self, node: str) -> bool:
        view = self.views.get(node)
        return view is not None and view.hb.phase != "exiting" and not self.gone(node)

    def faults(self, rec: JobRecord) -> list[Fault]:
        return detect_faults(rec, self.views, self.silence, self.cfg, self.exited())


class StragglerWatch:
    """The straggler monitor's findings on the current incarnation's ranks: news for the events topic and,
    under control.evict_stragglers, the one the policy is sure of as a fault (its node is checked, then evicted)."""

    def __init__(self, metrics: JobMetrics, cfg: JobConfig):
        self.metrics, self.cfg = metrics, cfg
        self.incarnation = 0  # the newest incarnation the timings came from
        self._news: list[tuple[Finding, bool]] = []  # (finding, cleared), from the consumer thread
        self._lock = threading.Lock()

    def observe(self, records: list[dict]) -> None:
        """On the metrics consumer's thread: a new incarnation starts a fresh monitor (its ranks restarted,
        its first steps are warm-up again)."""
        newest = max((r.get("incarnation") or 0 for r in records), default=0)
        if newest > self.incarnation:
            self.incarnation = newest
            names = self.metrics.monitor.node_names
            self.metrics.monitor = StragglerMonitor(self.cfg.ranks_per_node, node_names=names,
                                                    world_size=self.cfg.parallelism.world_size)
            self.metrics.findings = []
        records = [r for r in records if (r.get("incarnation") or 0) >= self.incarnation]
        new, cleared = self.metrics.observe(records)
        with self._lock:
            self._news += [(f, False) for f in new] + [(f, True) for f in cleared]

    def news(self, rec: JobRecord) -> list[tuple[Finding, bool]]:
        """Findings that appeared or cleared since the last call, named by the nodes now active."""
        names = {s.index: s.node for s in rec.slots("active")}
        self.metrics.monitor.node_names = [names.get(i, f"node{i}") for i in range(max(names, default=-1) + 1)]
        with self._lock:
            news, self._news = self._news, []
        return news

    def fault(self, rec: JobRecord) -> Optional[Fault]:
        if self.incarnation != rec.incarnation:  # findings of an older incarnation name ranks already restarted
            return None
        f = straggler_to_evict(self.metrics.findings, self.cfg.control)
        if f is None:
            return None
        return Fault("straggler", f.node_name, f"{describe(f)}; evicting its node (control.evict_stragglers)",
                     {"rank": f.rank, "segment": f.segment, "dimension": f.dimension, "slowdown": f.slowdown,
                      "confidence": f.confidence, "steps_reported": f.steps_reported})
