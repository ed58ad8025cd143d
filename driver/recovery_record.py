"""The recovery record: the newest fault and its handling, part of the job record (driver/state.py), which
the driver rewrites each pass and a restarted driver resumes from. driver/recovery/ fills it in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

FaultKind = Literal["node_dead", "rank_failed", "ranks_stopped", "rank_error", "nan_loss", "hang", "straggler",
                    "start_failed", "unresponsive", "evicted", "selfcheck_failed"]


@dataclass
class Fault:
    kind: FaultKind
    node: Optional[str]  # where it was found, or localised to; None: no node in particular
    message: str  # one line for `status` and the events topic
    detail: dict = field(default_factory=dict)


@dataclass
class Timeline:
    """One recovery's moments (epoch seconds) for MTTR: detect, diagnose, restart, catch up."""
    occurred: float  # best estimate of when the fault happened
    detected: float
    step: int  # the step training had reached: caught up once the next incarnation reaches it again
    incarnation: int  # the incarnation the fault struck
    diagnosed: Optional[float] = None  # the policy decided
    resumed: Optional[float] = None  # the next incarnation reported a step
    restored_step: Optional[int] = None  # the step it restored


@dataclass
class Recovery:
    """The newest fault and its handling (driver/recovery/); replaced by the next fault."""
    fault: Fault
    timeline: Optional[Timeline]  # None once training caught up: its figures are in JobRecord.recoveries
    suspects: list[str] = field(default_factory=list)  # nodes the self-check starts from
    later: list[str] = field(default_factory=list)  # nodes to self-check beside the restarted ranks
    bad: dict[str, str] = field(default_factory=dict)  # node -> why its self-check failed
    rechecked: list[str] = field(default_factory=list)  # nodes given their one retry (control.crashed_selfcheck)


@dataclass
class BackgroundCheck:
    """A self-check running beside the restarted ranks (a node-local fault's node, or a peer: recovery/selfcheck.py)."""
    seq: int  # of its `diagnose` command; the result comes under JobStore.selfchecks, not the acks
    sent: float  # epoch seconds
    retried: bool = False  # no second check after a failure (control.crashed_selfcheck=retry gives the fault's
    # own node one: this is it; a peer gets none)
