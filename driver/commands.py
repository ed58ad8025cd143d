"""Commands to the active nodes, awaited through the job record: a state sends its command (`rec.phase`)
once to each node and keeps the seq in `rec.waiting`; acknowledgements are matched by seq. So a driver
killed while waiting finds, in Redis, what it had sent and what was answered.
"""
from __future__ import annotations

import time
from typing import Callable

from . import crashpoints
from .state import JobRecord, JobStore, NodeSlot, Phase


class Commands:
    def __init__(self, store: JobStore, announce: Callable[..., None]):
        """`announce(etype, message, rec, node=..., **detail)`: the driver's events topic."""
        self.store, self.announce = store, announce

    def await_phase(self, rec: JobRecord, phase: Phase) -> None:
        """The state's next command: sent, and waited on, from now on."""
        rec.phase, rec.waiting, rec.waiting_since = phase, {}, time.time()
        self.store.save(rec)

    def send_all(self, rec: JobRecord, args: Callable[[NodeSlot], dict],
                 skip: Callable[[NodeSlot], bool] = lambda slot: False) -> None:
        """Sends the phase's command once to every active node not yet sent it; seqs go in the record."""
        op = rec.phase.value
        for slot in rec.slots("active"):
            if slot.node in rec.waiting or skip(slot):
                continue
            rec.waiting[slot.node] = self.store.send(slot.node, op, args(slot))
            self.store.save(rec)
            self.announce("command", f"{op} -> {slot.node}", rec, node=slot.node, seq=rec.waiting[slot.node])
            crashpoints.reach(self.store, op)

    def answers(self, rec: JobRecord) -> tuple[bool, dict[str, str], list[str]]:
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
