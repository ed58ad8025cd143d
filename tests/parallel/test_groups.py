"""Group layout and creation order (`groups_to_create`, what build_context creates): pure functions,
checked over many layouts."""
from __future__ import annotations

import itertools

import pytest

from megascale.parallel.topology import Layout, groups_to_create
from megascale.rendezvous import group_specs, world_group_specs

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (8, 4, 4), (2, 3, 5)]  # (tp, dp, pp)
KINDS = ["tp", "dp", "pp", "pp_forward", "pp_backward", "embedding"]

pytestmark = pytest.mark.timeout(90)  # a hang fails fast instead of stalling the suite


def layout(tp: int, dp: int, pp: int) -> Layout:
    return Layout(tp=tp, dp=dp, pp=pp)


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_layout_formula_and_membership(tp, dp, pp):
    world = layout(tp, dp, pp)
    for rank in range(world.world_size):
        t, d, p = world.coords_of(rank)
        assert rank == t + tp * (d + dp * p)
        groups = dict(groups_to_create(world, rank))
        assert list(groups) == KINDS
        assert groups["tp"] == [rank - t + i for i in range(tp)]  # TP innermost: contiguous
        assert groups["dp"] == [t + tp * (i + dp * p) for i in range(dp)]
        pipeline = [t + tp * (d + dp * i) for i in range(pp)]
        assert groups["pp"] == groups["pp_forward"] == groups["pp_backward"] == pipeline
        assert all(rank in members for members in groups.values())
        ends = sorted({groups["pp"][0], groups["pp"][-1]})
        assert groups["embedding"] == (ends if p in (0, pp - 1) else [rank])
        assert [s.kind for s in group_specs(world, rank)] == [k for k in KINDS if len(groups[k]) > 1]


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_each_kind_partitions_the_world(tp, dp, pp):
    world = layout(tp, dp, pp)
    by_kind: dict[str, list[list[int]]] = {}
    for kind, members in set((k, tuple(m)) for r in range(world.world_size) for k, m in groups_to_create(world, r)):
        by_kind.setdefault(kind, []).append(list(members))
    for kind in ("tp", "dp", "pp", "pp_forward", "pp_backward"):
        assert sorted(itertools.chain(*by_kind[kind])) == list(range(world.world_size)), kind
    assert sorted(itertools.chain(*by_kind["embedding"])) == list(range(world.world_size))  # ends + middles alone


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_every_rank_follows_the_global_order(tp, dp, pp):
    world = layout(tp, dp, pp)
    order = {(s.kind, tuple(s.ranks)): i for i, s in enumerate(world_group_specs(world))}
    assert len(order) == len(world_group_specs(world))  # each group once
    for rank in range(world.world_size):
        positions = [order[(s.kind, tuple(s.ranks))] for s in group_specs(world, rank)]
        assert positions == sorted(positions)


@pytest.mark.parametrize("tp,dp,pp", SHAPES + [(8, 32, 8)])
def test_blocking_creation_never_deadlocks(tp, dp, pp):
    """Play creation where a group completes only once every member has reached it."""
    world = layout(tp, dp, pp)
    todo = {r: [tuple(s.ranks) for s in group_specs(world, r)] for r in range(world.world_size)}
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
        world = layout(tp, dp, pp)
        slots = sum(len(s.ranks) for r in range(world.world_size) for s in group_specs(world, r))
        assert slots <= world.world_size * (tp + dp + 3 * pp + 2)
