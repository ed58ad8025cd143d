"""`megascale bench overlap`'s emulated section: where its ranks run, and its one line without root.

The benchmark itself (two 8-rank runs across a slow link) is too long for the suite; BENCHMARKS.md has its
measured JSON. Placing ranks in namespaces needs root and iproute2: that test skips naming the reason otherwise.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from megascale.bench import overlap
from megascale.common import netemu
from megascale.launch import run_ranks
from megascale.parallel.topology import Layout


def test_tp_stays_inside_a_node_while_dp_and_pp_cross():
    layout = Layout(**overlap.EMULATED)
    nodes = [overlap.node_of(r, layout) for r in range(layout.world_size)]
    assert sorted(nodes) == ["n0"] * 4 + ["n1"] * 4
    for rank in range(layout.world_size):
        assert {nodes[r] for r in layout.tp_members(rank)} == {nodes[rank]}
        assert len({nodes[r] for r in layout.dp_members(rank)}) == 2
        assert len({nodes[r] for r in layout.pp_members(rank)}) == 2


def test_without_root_the_emulated_section_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(netemu, "has_net_admin", lambda: False)
    assert overlap.emulated(quick=True, steps=1) == {"not_run": "cluster.network: emulated needs root (CAP_NET_ADMIN)"}


def _where(ctx) -> tuple[int, float]:
    """This rank's network namespace (inode) and the sum of an all-reduce across its DP group."""
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return os.stat("/proc/self/ns/net").st_ino, value.item()


def test_placed_ranks_run_in_their_nodes_namespaces_and_reach_each_other_across_the_bridge():
    try:
        netemu.require_net_admin()
    except netemu.NetworkError as e:
        pytest.skip(str(e))
    job, layout = f"bench-overlap-test-{os.getpid()}", Layout(dp=2)
    net = netemu.create(job)
    try:
        for node in ("n0", "n1"):
            netemu.add_node(net, node, 1)
        found = run_ranks(_where, layout, place=functools.partial(overlap.place, job, layout), backend="gloo")
        expected = [os.stat(f"/run/netns/{net.namespace(overlap.node_of(r, layout))}").st_ino for r in (0, 1)]
    finally:
        netemu.teardown(job)
    assert [ns for ns, _ in found] == expected and expected[0] != expected[1]
    assert [total for _, total in found] == [3.0, 3.0]


def test_the_link_rate_is_cluster_link_gbit_s_default_unless_given_and_a_bad_one_is_one_line(monkeypatch, capsys):
    from megascale import cli
    from megascale.config import ClusterConfig

    seen = []
    monkeypatch.setattr(overlap, "run", lambda args: seen.append(args.link_gbit) or {"link_gbit": args.link_gbit})
    assert cli.main(["bench", "overlap", "--json"]) == 0 and cli.main(["bench", "overlap", "--link-gbit", "0.5"]) == 0
    assert seen == [ClusterConfig.link_gbit, 0.5] and ClusterConfig.link_gbit == 2.0
    for bad in ("0", "-1", "nan", "inf", "fast"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "overlap", "--link-gbit", bad])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == \
            f"megascale bench: error: argument --link-gbit: '{bad}' is not a positive number"


def test_chaos_slow_link_refuses_a_rate_that_is_no_positive_number_in_one_line(capsys):
    from megascale import cli

    with pytest.raises(SystemExit) as exit_:  # `nan` reached tc's rate as int(nan * 1e9): a ValueError traceback
        cli.main(["chaos", "some-job", "slow-link", "--node", "n1", "--gbit", "nan"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("megascale chaos: argument --gbit: 'nan' is not a positive number "
                                               "(see megascale chaos --help)")


def test_chaos_slow_rank_and_link_down_refuse_nan_and_inf_in_one_line(capsys):
    from megascale import cli

    for argv in (["slow-rank", "--rank", "1", "--factor", "nan"], ["slow-rank", "--rank", "1", "--for", "inf"],
                 ["link-down", "--node", "n1", "--for", "nan"]):
        flag, bad = argv[-2:]  # nan passed `factor < 1` and `duration <= 0`: a NaN slow-down, a NaN deadline
        with pytest.raises(SystemExit) as exit_:
            cli.main(["chaos", "some-job", *argv])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == (f"megascale chaos: argument {flag}: '{bad}' is not a positive "
                                                   "number (see megascale chaos --help)")
