"""A straggler finding (stragglers.Finding) in words: the line `megascale status` shows and the event the
driver publishes."""
from __future__ import annotations

from megascale.common.messages import Event

from .stragglers import Finding


def describe(f: Finding) -> str:
    """One line for `megascale status` and the events topic."""
    ms = f"+{f.excess_s * 1e3:.1f} ms/step"
    evidence = f"steps {f.window[0]}-{f.window[1]}, confidence {f.confidence:.5f}"
    if f.dimension == "pp":
        return (f"straggler: stage pp{f.pp} (ranks {f.ranks[0]}-{f.ranks[-1]} on {f.node_name}"
                f"{'' if len(f.nodes) == 1 else ' and others'}): {f.segment} {f.slowdown:.2f}x its usual pace "
                f"against the other stages ({ms}; {evidence})")
    if len(f.ranks) > 1:
        return (f"straggler: TP group pp{f.pp} dp{f.dp} (ranks {f.ranks[0]}-{f.ranks[-1]} on {f.node_name}): "
                f"{f.segment} {f.slowdown:.2f}x the stage's other DP replicas ({ms}; {evidence})")
    return (f"straggler: rank {f.rank} on {f.node_name} (tp{f.tp} pp{f.pp} dp{f.dp}): {f.segment} "
            f"{f.slowdown:.2f}x its {f.dimension} peers ({ms}; {evidence})")


def to_event(job: str, f: Finding, cleared: bool = False) -> Event:
    message = f"straggler cleared: rank {f.rank} on {f.node_name}" if cleared else describe(f)
    return Event(job=job, type="node", message=message, node=f.node_name,
                 detail={"straggler": f.to_dict(), "cleared": cleared})
