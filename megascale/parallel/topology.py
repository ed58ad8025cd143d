"""This rank's process groups, built from its coordinates (layout.py): the one owner every component asks."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.parallel.layout import Layout, groups_to_create
from megascale.timers import StepTimer


@dataclass
class Group:
    """A process group plus this rank's place in it; size 1 means no communication."""

    ranks: list[int]
    rank: int  # index of this process within `ranks`
    pg: Any = None
    kind: str = "dp"  # which communication timer its traffic counts towards: tp, pp or dp
    timer: StepTimer = field(default_factory=lambda: StepTimer(enabled=False))
    name: str = ""  # unique in the job, e.g. "dp:4" (group kind and first member)
    recorder: Optional["FlightRecorder"] = None  # noqa: F821 - set by ParallelContext.attach_recorder

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]


@dataclass
class ParallelContext:
    """This rank's coordinates and groups; passed explicitly, never read from globals."""

    layout: Layout
    rank: int
    device: torch.device
    tp: Group
    dp: Group
    pp: Group
    pp_forward: Group  # activations flow on their own communicator ...
    pp_backward: Group  # ... and gradients on another, so pp=2 (prev == next) never mixes the two streams
    embedding: Group
    sequence_parallel: bool = False
    timer: StepTimer = field(default_factory=lambda: StepTimer(enabled=False))

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def groups(self) -> list[Group]:
        return [self.tp, self.dp, self.pp, self.pp_forward, self.pp_backward, self.embedding]

    def attach_recorder(self, recorder) -> None:
        """Every communication operation of this rank is recorded from now on (hang localisation)."""
        for group in self.groups:
            group.recorder = recorder

    def rebind(self, other: "ParallelContext") -> None:
        """Takes `other`'s process groups, flight recorder and timer into this context's own Group objects,
        which a kept model's modules and optimizer hold: an in-process restart keeps them (same rank, same
        layout) and builds only the groups of the new incarnation."""
        if (self.layout, self.rank, self.device) != (other.layout, other.rank, other.device):
            raise ValueError(f"cannot rebind {self.describe()} to {other.describe()}")
        for mine, theirs in zip(self.groups, other.groups):
            mine.pg, mine.recorder, mine.timer = theirs.pg, theirs.recorder, theirs.timer
        self.timer = other.timer

    def unbind(self) -> None:
        """Lets go of the process groups and recorder (the incarnation is over), so they can be destroyed."""
        for group in self.groups:
            group.pg, group.recorder = None, None

    def describe(self) -> str:
        return (f"rank {self.rank} (tp {self.tp.rank}/{self.tp.size}, pp {self.pp.rank}/{self.pp.size}, "
                f"dp {self.dp.rank}/{self.dp.size})")


# The timer each group's traffic counts towards; the tied-embedding sync crosses stages.
_TIMER_KIND = {"tp": "tp", "dp": "dp", "pp": "pp", "pp_forward": "pp", "pp_backward": "pp", "embedding": "pp"}


def build_context(layout: Layout, rank: int, device: Optional[torch.device] = None,
                  sequence_parallel: bool = False, timeout: Optional[timedelta] = None) -> ParallelContext:
    """Creates this rank's groups (torch.distributed must be initialised when world > 1). `timeout` is
    every group's collective timeout (`comm.timeout_s`): torch gives a new group its own default
    (30 min), not the one the process group was initialised with."""
    device = device or torch.device("cpu")
    timer = StepTimer(device)
    groups = {}
    for name, members in groups_to_create(layout, rank):
        pg = None
        if len(members) > 1:
            # Local synchronisation names a group by its members and the number of groups this
            # process made before, so every rank creates its groups in the same order (this list).
            # Eager NCCL init (init_process_group(device_id=...)) would need every rank in every
            # split; we do not pass device_id, so communicators are created lazily per group.
            pg = dist.new_group(members, timeout=timeout, use_local_synchronization=True,
                                group_desc=f"{name}:{members[0]}")
        groups[name] = Group(ranks=members, rank=members.index(rank), pg=pg, kind=_TIMER_KIND[name], timer=timer,
                             name=f"{name}:{members[0]}")
    return ParallelContext(layout=layout, rank=rank, device=device, sequence_parallel=sequence_parallel,
                           timer=timer, **groups)


def single_device_context(device: Optional[torch.device] = None) -> ParallelContext:
    """A 1-rank context that needs no torch.distributed at all."""
    return build_context(Layout(), 0, device)
