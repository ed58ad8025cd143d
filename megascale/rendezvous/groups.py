"""Which parallel groups each rank creates, in an order that needs no global barrier.

Rank layout: TP innermost, then DP, then PP outermost:
    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Every rank creates its groups kind by kind in KINDS order, and belongs to at most one group
per kind. So a rank waiting inside a group's creation only waits for that group's members,
and they are all at the same kind: no cycle, no deadlock, no rank ever waits on a
non-member. Each rank's list is a subsequence of `all_group_specs`, the one global order
used when every rank must call `new_group` for every group.

torch names a `use_local_synchronization=True` group after its ranks *and* how many groups
the calling process has created so far, so members must have created equally many groups
before it. Uniform kinds guarantee that. The embedding kind comes last because only first
and last pipeline stages create it: create any later local-sync group on every rank alike
(or before these), or its members will disagree on its name and wait out the timeout.
"""
from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from megascale.parallel.topology import Layout, groups_to_create

# Creation order. pp_forward/pp_backward have the PP members but their own communicators, so forward
# and backward pipeline sends never queue behind each other.
KINDS = ("tp", "dp", "pp", "pp_forward", "pp_backward", "embedding")


class GroupSpec(NamedTuple):
    kind: str
    ranks: list[int]


def rank_coords(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    _check_layout(tp, dp, pp, rank)
    return Layout(tp=tp, pp=pp, dp=dp).coords_of(rank)


def group_specs(tp: int, dp: int, pp: int, rank: int) -> list[GroupSpec]:
    """The groups `rank` is a member of, in creation order, each tagged with its kind.

    The order is the engine's (`megascale.parallel.topology.groups_to_create`); a middle
    pipeline stage has no embedding group. A position-embedding group would be {first
    stage} alone in this layout: one rank, no communicator needed.
    """
    _check_layout(tp, dp, pp, rank)
    layout = Layout(tp=tp, pp=pp, dp=dp)
    ends = layout.pp_members(rank)[0], layout.pp_members(rank)[-1]
    return [GroupSpec(kind, members) for kind, members in groups_to_create(layout, rank)
            if kind != "embedding" or rank in ends]


def groups_for_rank(tp: int, dp: int, pp: int, rank: int) -> list[list[int]]:
    """The member lists `rank` passes to `new_group`, in order (see `group_specs`)."""
    return [spec.ranks for spec in group_specs(tp, dp, pp, rank)]


def all_group_specs(tp: int, dp: int, pp: int) -> list[GroupSpec]:
    """Every group in the world, in the one global order each rank's list follows."""
    seen: dict[tuple[str, tuple[int, ...]], GroupSpec] = {}
    for rank in range(tp * dp * pp):
        for spec in group_specs(tp, dp, pp, rank):
            seen.setdefault((spec.kind, tuple(spec.ranks)), spec)
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(seen.values(), key=lambda s: (order[s.kind], s.ranks))


def create_groups(
    tp: int,
    dp: int,
    pp: int,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    local_sync: bool | None = None,
) -> dict[str, dist.ProcessGroup]:
    """Create this rank's parallel groups after `init_process_group`; returns {kind: group}.

    One-member groups need no communicator and are left out of the result (so with pp=1
    there is no pp/embedding entry); never pass None to a collective, that means WORLD.

    local_sync=True (the default with lazy communicator init): each rank creates only its own
    groups with `use_local_synchronization=True`; store traffic and any
    TORCH_DIST_INIT_BARRIER=1 barrier involve group members only.
    local_sync=False (forced when the default group is bound to a device, i.e. eager NCCL
    init): every rank calls `new_group` for every group in global order, because NCCL then
    creates groups by `ncclCommSplit`, which every rank of the parent must join.
    """
    if not dist.is_initialized():
        raise RuntimeError("create_groups needs torch.distributed.init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp * dp * pp != world:
        raise ValueError(
            f"tp*dp*pp = {tp}*{dp}*{pp} = {tp * dp * pp} but world_size is {world}: fix the parallel layout")
    eager = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None
    if local_sync is None:
        local_sync = not eager
    elif local_sync and eager:
        raise ValueError("local_sync=True with eager NCCL init (device_id=...) hangs in ncclCommSplit: "
                         "pass local_sync=False or init without device_id")
    specs = group_specs(tp, dp, pp, rank) if local_sync else all_group_specs(tp, dp, pp)
    groups: dict[str, dist.ProcessGroup] = {}
    for spec in specs:
        if len(spec.ranks) == 1:  # same size for every group of a kind, so every rank skips alike
            continue
        pg = dist.new_group(spec.ranks, timeout=timeout, backend=backend,
                            use_local_synchronization=local_sync, group_desc=spec.kind)
        if rank in spec.ranks:
            groups[spec.kind] = pg
    return groups


def _check_layout(tp: int, dp: int, pp: int, rank: int) -> None:
    if min(tp, dp, pp) < 1:
        raise ValueError(f"tp, dp and pp must be >= 1, got tp={tp} dp={dp} pp={pp}")
    if not 0 <= rank < tp * dp * pp:
        raise ValueError(f"rank {rank} outside world of tp*dp*pp = {tp * dp * pp} ranks")
