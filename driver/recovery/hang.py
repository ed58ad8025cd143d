"""The hang clock (MegaScale §4.1): every node heartbeats, but training makes no progress.

A hung collective leaves each rank's process alive and its executor reporting, so no heartbeat shows
the fault; only the step that stops moving does. How long is too long follows the job: a fixed ceiling
(control.hang_after_s) until the step intervals are known, then a multiple of the slowest recent one
(control.hang_after_steps), the way NVIDIA's resiliency extension sizes its timeouts from observed intervals.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

from megascale.config import JobConfig

from ..ingest import NodeView
from ..recovery_record import Fault
from ..state import JobRecord


def progress(rec: JobRecord, views: dict[str, NodeView]) -> dict:
    """The newest step of the current incarnation that any node reported, with its loss and timings (and
    the newest validation's)."""
    best: dict = {}
    for view in views.values():
        hb = view.hb
        if hb.incarnation == rec.incarnation and hb.step is not None and hb.step >= best.get("step", -1):
            if hb.loss is not None or "loss" not in best:
                best = {"step": hb.step, "loss": hb.loss, "tokens_per_s": hb.tokens_per_s,
                        "val_step": hb.val_step, "val_loss": hb.val_loss, "val_ppl": hb.val_ppl,
                        "step_time": hb.step_time, "age_s": hb.step_age_s,
                        "seen": view.wall - (hb.step_age_s or 0.0),  # when the node saw it, by our clock
                        "heard": view.wall}  # when that word came
    return best


def checkpoint_waits(rec: JobRecord, views: dict[str, NodeView]) -> list[tuple[float, str, str]]:
    """(since, what, node) for every active node whose ranks this incarnation wait outside a step."""
    return [(v.hb.waiting_since or time.time(), v.hb.waiting, s.node) for s in rec.slots("active")
            if (v := views.get(s.node)) and v.hb.incarnation == rec.incarnation and v.hb.waiting]


RECENT_INTERVALS = 16  # step intervals the adaptive limit looks back over
KNOWN_AFTER = 3  # intervals seen before they set the limit (the first steps warm up)


class HangClock:
    """When the (incarnation, step) last changed; a hang is that moment too long ago."""

    def __init__(self) -> None:
        self.last: tuple[int, Optional[int]] = (0, None)  # (incarnation, step)
        self.since = time.time()
        # Seconds per step, within each incarnation; a restart keeps them (the same steps), a shrink does not.
        self.intervals: deque[float] = deque(maxlen=RECENT_INTERVALS)
        self.dp: Optional[int] = None  # JobRecord.dp they were seen at
        self._announced: tuple = ()  # the checkpoint wait last reported as not a hang

    @property
    def step(self) -> Optional[int]:
        return self.last[1]

    def track(self, rec: JobRecord, seen: dict, waits: list[tuple[float, str, str]]) -> None:
        """Moves the clock to a new step (noting the seconds per step since the last one); a wait outside
        a step holds it until the wait ends."""
        key, now = (rec.incarnation, seen.get("step")), time.time()
        if key != self.last:
            at = min(now, seen.get("seen", now))
            (incarnation, step), (new_incarnation, new_step) = self.last, key
            if rec.dp != self.dp:  # shrunk or grown back: steps of another length
                self.intervals.clear()
                self.dp = rec.dp
            elif new_incarnation == incarnation and None not in (step, new_step) and new_step > step:
                self.intervals.append(max(0.0, at - self.since) / (new_step - step))
            self.last, self.since = key, at
        elif waits:  # ranks blocked outside a step (a checkpoint persisting): the clock restarts when it ends
            self.since = now

    def limit(self, cfg: JobConfig) -> tuple[float, str]:
        """Seconds without progress that make a hang, and the setting they come from."""
        ctl = cfg.control
        if ctl.hang_after_steps and len(self.intervals) >= KNOWN_AFTER:
            slowest = max(self.intervals)
            adaptive = max(ctl.dead_after_s, ctl.hang_after_steps * slowest)
            if adaptive < ctl.hang_after_s:
                return adaptive, (f"control.hang_after_steps={ctl.hang_after_steps:g} x the slowest recent step, "
                                  f"{slowest:.2f} s")
        return ctl.hang_after_s, "control.hang_after_s"

    def check(self, rec: JobRecord, cfg: JobConfig, seen: dict, waits: list[tuple[float, str, str]],
              announce: Callable[[str, str], None]) -> Optional[Fault]:
        """A hang, if the step has not moved for `limit` (before the incarnation's first step: for
        control.start_timeout_s, as ranks load and restore first; after the last one: for
        control.command_timeout_s, as they commit and exit; while ranks wait on a checkpoint persisting:
        for checkpoint.persist_timeout_s; in a validation: for control.hang_after_s). `announce(message, node)`
        tells of a wait that is not a hang."""
        ctl, step = cfg.control, self.step
        if not ctl.hang_after_s:
            return None
        if waits:
            since_wall, what, node = min(waits)
            waited = time.time() - since_wall
            persisting = what.startswith("checkpoint")
            allowed, setting, cause = ((cfg.checkpoint.persist_timeout_s, "checkpoint.persist_timeout_s",
                                        "storage stuck or too slow") if persisting else
                                       (ctl.hang_after_s, "control.hang_after_s", "a collective stuck"))
            if waited > allowed:
                return Fault("hang", node, f"no training progress: ranks on {node} have waited {waited:.0f} s for "
                             f"{what} ({cause}; {setting})", {"step": step, "waiting": what})
            if persisting and self._announced != (rec.incarnation, what):  # a validation is routine: not news
                self._announced = (rec.incarnation, what)
                announce(f"training waits for {what} on {node}: not a hang until {setting}={allowed:.0f} s", node)
            return None
        quiet = time.time() - max(self.since, rec.entered)
        if step is not None and (age := seen.get("age_s")) is not None:
            # The node's own word that the step is still the newest, so late heartbeats are not taken for
            # a hang (a node that stops reporting is dead_after_s's case). It is carried forward by the time
            # since it came, up to one heartbeat period (as long as a node on time is quiet): else a hang
            # would be found up to a period after its limit.
            since_heard = max(0.0, time.time() - seen.get("heard", time.time()))
            quiet = min(quiet, age + min(since_heard, ctl.heartbeat_s))
        after, setting = self.limit(cfg)
        if step is None:
            after = max(after, ctl.start_timeout_s)
        elif step >= cfg.train.steps:  # the last step is done: ranks commit and exit
            after = max(after, ctl.command_timeout_s)
        if quiet <= after:
            return None
        if step is None:
            return Fault("hang", None, f"incarnation {rec.incarnation} reported no step within {quiet:.0f} s "
                         f"of starting while every node heartbeats (control.start_timeout_s)", {"step": None})
        return Fault("hang", None, f"no training progress for {quiet:.0f} s after step {step} "
                     f"while every node heartbeats (limit {after:.0f} s: {setting})", {"step": step})
