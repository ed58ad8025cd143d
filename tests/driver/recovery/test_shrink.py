"""control.no_spare: shrink without a cluster: the dp a job shrinks to, the config its ranks get there, which
nodes run it, and the restart that grows it back (the end-to-end run with GPT ranks: test_shrink_gpt.py)."""
from __future__ import annotations

import pytest

from megascale.config import ConfigError, from_dict
from megascale.driver.pool import NodePool
from megascale.driver.recovery import shrink
from megascale.driver.state import JobRecord
from megascale.elastic import resized, shrunk_dp

from control_plane_support import StubBackend  # noqa: E402 - tests/driver is on sys.path (conftest)


def raw(**sections) -> dict:
    config = {"name": "j", "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
              "parallelism": {"tp": 2, "dp": 2}, "batch": {"micro": 1, "global": 4}, "cluster": {"nodes": 2},
              "control": {"no_spare": "shrink"}}
    for name, fields in sections.items():
        config[name] = {**config.get(name, {}), **fields}
    return config


@pytest.mark.parametrize("sections, nodes, expected", [
    ({}, 1, 1),  # tp2 on each of 2 nodes
    ({"parallelism": {"tp": 1, "dp": 8}, "batch": {"global": 24}, "cluster": {"nodes": 4}}, 3, 6),
    ({"parallelism": {"tp": 1, "dp": 8}, "batch": {"global": 8}, "cluster": {"nodes": 4}}, 3, 4),  # 6 ∤ 8
    ({"parallelism": {"tp": 1, "dp": 8}, "batch": {"global": 8}, "cluster": {"nodes": 4}}, 1, 2),
    ({"parallelism": {"tp": 2, "pp": 2, "dp": 2}, "cluster": {"nodes": 4}}, 3, 1),  # 4 ranks a replica: 2 nodes
    ({"parallelism": {"tp": 2, "pp": 2, "dp": 2}, "cluster": {"nodes": 4}}, 1, None),
])
def test_shrinks_to_the_largest_dp_the_nodes_hold_with_the_same_global_batch(sections, nodes, expected):
    assert shrunk_dp(from_dict(raw(**sections)), nodes) == expected


def test_shrink_is_refused_in_one_line_when_one_lost_node_leaves_no_smaller_layout():
    for sections in ({"parallelism": {"dp": 1}, "cluster": {"nodes": 1}},  # nothing smaller than dp=1
                     {"parallelism": {"tp": 2, "pp": 2, "dp": 1}, "cluster": {"nodes": 2}}):  # one replica, 2 nodes
        with pytest.raises(ConfigError, match=r"^control\.no_spare=shrink: no dp below parallelism\.dp=1 runs on "):
            from_dict(raw(**sections))
    assert from_dict(raw(control={"no_spare": "pause"}, parallelism={"dp": 1}, cluster={"nodes": 1}))


def test_the_ranks_of_a_shrunk_job_get_its_dp_and_more_microbatches_per_rank():
    config = raw()
    cfg = from_dict(config)
    small = from_dict(resized(config, cfg, 1))  # what the ranks validate
    assert (small.parallelism.dp, small.cluster.nodes, small.batch.global_) == (1, 1, 4)
    assert (cfg.microbatches, small.microbatches) == (2, 4)
    assert resized(config, cfg, None) is config


def pool_and_record(config: dict) -> tuple[NodePool, JobRecord]:
    pool = NodePool(StubBackend(), from_dict(config))
    rec = JobRecord(job="j", config=config, run_dir="/r")
    pool.ensure(rec)
    return pool, rec


def test_a_lost_node_shrinks_the_job_onto_the_rest_and_a_new_spare_grows_it_back():
    config = raw()
    pool, rec = pool_and_record(config)
    pool.evict(rec, "n0")  # no spare left: position 0 stays empty
    assert shrink.place(rec, pool.cfg, pool) == "shrunk to dp=1: 1 node short"
    assert rec.dp == 1 and [(s.node, s.index) for s in rec.slots("active")] == [("n1", 0)]
    assert pool.missing(rec) == 0 and "at dp=1 of 2" in shrink.describe(rec, pool.cfg)
    assert shrink.place(rec, pool.cfg, pool) is None  # another restart with the same nodes: no news

    pool.ensure(rec, spares=1)  # `megascale spares j 1`
    assert shrink.place(rec, pool.cfg, pool) == "grew back to dp=2"
    assert rec.dp is None and [(s.node, s.index) for s in rec.slots("active")] == [("n1", 0), ("n2", 1)]
    assert pool.missing(rec) == 0 and shrink.describe(rec, pool.cfg) == ""


def test_nodes_a_smaller_world_has_no_room_for_wait_as_spares():
    config = raw(parallelism={"tp": 1, "dp": 4}, cluster={"nodes": 4})  # global 4: dp 3 does not divide it
    pool, rec = pool_and_record(config)
    pool.evict(rec, "n1")
    assert shrink.place(rec, pool.cfg, pool) == "shrunk to dp=2: 1 node short"
    assert [(s.node, s.index) for s in rec.slots("active")] == [("n0", 0), ("n2", 1)]
    assert [s.node for s in rec.slots("spare")] == ["n3"]


def test_under_pause_a_lost_node_leaves_its_position_empty():
    pool, rec = pool_and_record(raw(control={"no_spare": "pause"}))
    pool.evict(rec, "n0")
    assert shrink.place(rec, pool.cfg, pool) is None and rec.dp is None and pool.missing(rec) == 1
