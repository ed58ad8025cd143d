"""Where the next incarnation runs when nodes are short (control.no_spare, MegaScale-style elastic dp).

`pause`: a position nobody fills waits for a spare. `shrink`: the job restarts at the largest dp the
live nodes (active and spare) hold (megascale/elastic.py), on positions 0..k-1; once they hold the
configured layout again, the next restart grows back. Only a restart changes the layout: ranks run
one world from start to stop.
"""
from __future__ import annotations

from typing import Optional

from megascale.config import JobConfig
from megascale.elastic import nodes_at, shrunk_dp

from ..pool import NodePool
from ..state import JobRecord


def place(rec: JobRecord, cfg: JobConfig, pool: NodePool) -> Optional[str]:
    """Before a (re)start: chooses the dp (`rec.dp`) and the nodes of the next incarnation. Returns what
    changed, for the events, or None. Positions still short afterwards (no layout fits) pause the job."""
    active, spares = rec.slots("active"), [s for s in rec.slots("spare") if not s.dead]
    live = len(active) + len(spares)
    dp = None if live >= cfg.cluster.nodes else shrunk_dp(cfg, live)
    if cfg.control.no_spare == "pause" or (dp is None and live < cfg.cluster.nodes):
        pool.refill_position(rec)
        return None
    before, rec.dp = rec.dp, dp
    used = nodes_at(cfg, dp)
    for position, slot in enumerate(active):  # kept in order; one the smaller world has no room for waits as a spare
        slot.role, slot.index = ("active", position) if position < used else ("spare", None)
    pool.refill_position(rec)
    if dp == before:
        return None
    missing = cfg.cluster.nodes - live
    short = f"{missing} node{'s' if missing > 1 else ''} short"
    if dp is None:
        return f"grew back to dp={cfg.parallelism.dp}"
    return f"{'grew' if before is not None and dp > before else 'shrunk'} to dp={dp}: {short}"


def describe(rec: JobRecord, cfg: JobConfig) -> str:
    """The layout an incarnation runs at, for its start reason: empty at the configured dp."""
    if rec.dp is None:
        return ""
    return (f" at dp={rec.dp} of {cfg.parallelism.dp} (control.no_spare=shrink; a restart with "
            f"{cfg.cluster.nodes - nodes_at(cfg, rec.dp)} more node(s) grows it back)")
