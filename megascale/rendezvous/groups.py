"""The store traffic of group creation: which groups a rank creates, and why no global barrier is needed.

`megascale.parallel.topology.build_context` creates them; this module names the groups it creates with a
communicator, for the `megascale bench init` simulation and the tests of the order.

Every rank creates its groups kind by kind in `groups_to_create` order, and belongs to at most one
group per kind. So a rank waiting inside a group's creation only waits for that group's members,
and they are all at the same kind: no cycle, no deadlock, no rank ever waits on a non-member.

torch names a `use_local_synchronization=True` group after its ranks *and* how many groups the
calling process has created so far, so members must have created equally many groups before it.
Uniform kinds guarantee that. The embedding kind comes last because only first and last pipeline
stages create it: create any later local-sync group on every rank alike (or before these), or its
members will disagree on its name and wait out the timeout.
"""
from __future__ import annotations

from typing import NamedTuple

from megascale.parallel.layout import Layout, groups_to_create


class GroupSpec(NamedTuple):
    kind: str
    ranks: list[int]


def group_specs(layout: Layout, rank: int) -> list[GroupSpec]:
    """The groups `rank` creates a communicator for, in creation order (one-member groups need none)."""
    return [GroupSpec(kind, members) for kind, members in groups_to_create(layout, rank) if len(members) > 1]


def world_group_specs(layout: Layout) -> list[GroupSpec]:
    """Every group in the world, in the one global order each rank's own list follows: the order
    every rank walks when each must call `new_group` for every group (no local synchronisation)."""
    kinds = [kind for kind, _ in groups_to_create(layout, 0)]
    seen = {(spec.kind, tuple(spec.ranks)): spec for rank in range(layout.world_size)
            for spec in group_specs(layout, rank)}
    return sorted(seen.values(), key=lambda s: (kinds.index(s.kind), s.ranks))
