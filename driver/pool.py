"""Which nodes are active (and in which rank position) and which are hot spares.

Node ids are n0, n1, ... in order of creation and never reused, so an evicted node can never
come back by accident. A spare that takes an evicted node's place takes its position too,
so every other node keeps its ranks.
"""
from __future__ import annotations

from typing import Optional

from megascale.config import JobConfig
from megascale.elastic import nodes_at

from . import log
from .backend import Backend
from .state import JobRecord, NodeSlot


class NodePool:
    def __init__(self, backend: Backend, cfg: JobConfig):
        self.backend, self.cfg = backend, cfg

    def _new_slot(self, rec: JobRecord, role: str, index: Optional[int] = None) -> NodeSlot:
        slot = NodeSlot(node=f"n{rec.next_node}", role=role, index=index)  # type: ignore[arg-type]
        rec.next_node += 1
        rec.nodes.append(slot)
        return slot

    def ensure(self, rec: JobRecord, spares: Optional[int] = None) -> list[str]:
        """Creates the slots on first use, tops up the spares (`spares`, else cluster.spares), starts
        nodes never started; returns those started."""
        if not rec.nodes:
            for i in range(self.cfg.cluster.nodes):
                self._new_slot(rec, "active", i)
        while len(rec.slots("spare")) < (self.cfg.cluster.spares if spares is None else spares):
            self._new_slot(rec, "spare")
        todo = [s for s in rec.nodes if not s.started and s.role != "evicted"]
        for s in todo:
            s.started = True  # recorded before starting: a crash here leaves a node that never reports, not two
        if todo:
            self.backend.start([s.node for s in todo])
        return [s.node for s in todo]

    def evict(self, rec: JobRecord, node: str) -> Optional[NodeSlot]:
        """Evicts `node`; an active node's place goes to a live spare. Returns that spare, if any."""
        slot = rec.slot(node)
        assert slot is not None and slot.role != "evicted"
        index, was_active = slot.index, slot.role == "active"
        slot.role, slot.index = "evicted", None
        self.backend.evict(node)
        self.backend.forget_evicted(rec.forget_old_evicted())
        if not was_active:
            return None
        spare = next((s for s in rec.slots("spare") if not s.dead), None)
        if spare is None:
            log.warning("no spare to replace %s", node)
            return None
        spare.role, spare.index = "active", index
        return spare

    def missing(self, rec: JobRecord) -> int:
        """Active positions nobody fills (an eviction with no spare left), at the dp the record runs at."""
        return nodes_at(self.cfg, rec.dp) - len(rec.slots("active"))

    def refill_position(self, rec: JobRecord) -> None:
        """Gives each unfilled active position to a live spare, if one has appeared."""
        taken = {s.index for s in rec.slots("active")}
        for index in range(nodes_at(self.cfg, rec.dp)):
            if index not in taken:
                spare = next((s for s in rec.slots("spare") if not s.dead), None)
                if spare is None:
                    return
                spare.role, spare.index = "active", index
