"""Which loader a rank of a job uses: one per node of the job's layout (a node may be a network namespace or
a pod of its own, where another node's abstract socket cannot be reached), named apart from every other
run's, even runs that share train.run_dir (its default, "runs", is shared by every job started in a folder)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from megascale.config import from_dict
from megascale.train import make_source

WORLD = 4


def job(dataset, tmp_path):
    return from_dict({"model": {"seq": 16, "vocab": 512}, "parallelism": {"dp": WORLD},
                      "batch": {"micro": 2, "global": 4 * WORLD}, "cluster": {"nodes": 2, "ranks_per_node": 2},
                      "data": {"source": "shards", "path": str(dataset), "tokenizer": "byte"},
                      "train": {"run_dir": str(tmp_path / "runs")}})


def rank_context(rank: int) -> SimpleNamespace:
    group = lambda r, size: SimpleNamespace(rank=r, size=size)  # noqa: E731
    return SimpleNamespace(rank=rank, dp=group(rank, WORLD), tp=group(0, 1), pp=group(0, 1))


def test_each_node_of_each_run_has_its_own_loader_and_the_runs_read_alike(dataset, tmp_path):
    cfg = job(dataset, tmp_path)
    runs = {}
    try:
        for name in ("a", "b"):  # two runs at once, both under the same train.run_dir
            runs[name] = []
            for rank in range(WORLD):
                runs[name].append(make_source(cfg, rank_context(rank), run_dir=str(tmp_path / "runs" / name)))
        for sources in runs.values():
            assert len({s.loader_pid for s in sources}) == 2, "one loader per node of cluster.ranks_per_node"
            assert [s.node for s in sources] == [0, 0, 1, 1]
        assert not {s.cfg.socket for s in runs["a"]} & {s.cfg.socket for s in runs["b"]}
        for _ in range(3):  # the same seed: the same batches, each run from its own loaders
            batches = {name: [s.next_batch()[0] for s in sources] for name, sources in runs.items()}
            assert all(torch.equal(x, y) for x, y in zip(batches["a"], batches["b"]))
    finally:
        for sources in runs.values():
            for s in reversed(sources):
                s.close()
