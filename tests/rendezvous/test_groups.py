"""Group layout and creation order: pure functions, checked over many layouts."""
from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch.distributed as dist

from megascale.rendezvous import (
    KINDS,
    all_group_specs,
    create_groups,
    group_specs,
    groups_for_rank,
    rank_coords,
)

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (8, 4, 4), (2, 3, 5)]

pytestmark = pytest.mark.timeout(90)  # a hang fails fast instead of stalling the suite


@pytest.mark.parametrize("tp,dp,pp", LAYOUTS)
def test_layout_formula_and_membership(tp, dp, pp):
    world = tp * dp * pp
    for rank in range(world):
        t, d, p = rank_coords(rank, tp, dp, pp)
        assert rank == t + tp * (d + dp * p)
        specs = {s.kind: s.ranks for s in group_specs(tp, dp, pp, rank)}
        assert specs["tp"] == [rank - t + i for i in range(tp)]  # TP innermost: contiguous
        assert specs["dp"] == [t + tp * (i + dp * p) for i in range(dp)]
        assert specs["pp"] == specs["pp_forward"] == specs["pp_backward"] == [t + tp * (d + dp * i) for i in range(pp)]
        assert all(rank in members for members in specs.values())
        assert ("embedding" in specs) == (p in (0, pp - 1))
        if "embedding" in specs:
            assert specs["embedding"] == sorted({specs["pp"][0], specs["pp"][-1]})


@pytest.mark.parametrize("tp,dp,pp", LAYOUTS)
def test_each_kind_partitions_the_world(tp, dp, pp):
    world = tp * dp * pp
    by_kind: dict[str, list[list[int]]] = {}
    for spec in all_group_specs(tp, dp, pp):
        by_kind.setdefault(spec.kind, []).append(spec.ranks)
    for kind in ("tp", "dp", "pp", "pp_forward", "pp_backward"):
        assert sorted(itertools.chain(*by_kind[kind])) == list(range(world)), kind
    stages = {0, pp - 1}
    members = sorted(itertools.chain(*by_kind["embedding"]))
    assert members == [r for r in range(world) if rank_coords(r, tp, dp, pp)[2] in stages]


@pytest.mark.parametrize("tp,dp,pp", LAYOUTS)
def test_every_rank_follows_the_global_order(tp, dp, pp):
    order = {(s.kind, tuple(s.ranks)): i for i, s in enumerate(all_group_specs(tp, dp, pp))}
    for rank in range(tp * dp * pp):
        positions = [order[(s.kind, tuple(s.ranks))] for s in group_specs(tp, dp, pp, rank)]
        assert positions == sorted(positions)
        first_or_last = rank_coords(rank, tp, dp, pp)[2] in (0, pp - 1)
        expected = [k for k in KINDS if k != "embedding" or first_or_last]
        assert [s.kind for s in group_specs(tp, dp, pp, rank)] == expected


@pytest.mark.parametrize("tp,dp,pp", LAYOUTS + [(8, 32, 8)])
def test_blocking_creation_never_deadlocks(tp, dp, pp):
    """Play creation where a group completes only once every member has reached it."""
    world = tp * dp * pp
    todo = {r: [tuple(m) for m in groups_for_rank(tp, dp, pp, r)] for r in range(world)}
    rounds = 0
    while any(todo.values()):
        heads = {r: lst[0] for r, lst in todo.items() if lst}
        ready = {g for g in heads.values() if all(heads.get(m) == g for m in g)}
        assert ready, f"deadlock after {rounds} rounds"
        for r, g in heads.items():
            if g in ready:
                todo[r].pop(0)
        rounds += 1
    assert rounds <= len(KINDS)  # every kind completes in one wave: no rank waits on another kind


def test_store_traffic_is_linear_in_world_size():
    # Member slots a rank touches: tp + dp + 3 pp (+2 embedding); independent of world size.
    for tp, dp, pp in [(8, 8, 4), (8, 16, 8), (8, 32, 8)]:
        world = tp * dp * pp
        slots = sum(len(m) for r in range(world) for m in groups_for_rank(tp, dp, pp, r))
        assert slots <= world * (tp + dp + 3 * pp + 2)


def test_bad_layouts_name_the_problem():
    with pytest.raises(ValueError, match="outside world"):
        group_specs(2, 2, 2, 8)
    with pytest.raises(ValueError, match=">= 1"):
        rank_coords(0, 0, 1, 1)


def test_create_groups_checks_world_size(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="world_size is 1"):
            create_groups(2, 1, 1)
        assert create_groups(1, 1, 1) == {}  # every group would be this rank alone
    finally:
        dist.destroy_process_group()
