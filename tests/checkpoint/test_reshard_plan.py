"""Resharding without ranks: every rank of one layout is built in this process (the real model, TP
plan and ZeRO optimizer, with groups that never communicate) and its shard image written; every rank
of another layout restores from those images. The oracle is the new layout's own optimizer, built
from the same seed: what it starts with is exactly what its slice of the old state must restore to."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megascale.checkpoint.host_buffer import HostBuffer
from megascale.checkpoint.reshard import TPSlice, copy_intervals, overlaps, slice_sources
from megascale.checkpoint.restore_plan import Assembly
from megascale.checkpoint.save_plan import SavePlan, tensor_table
from megascale.checkpoint.shard_format import read_shard
from megascale.checkpoint.stateful import Split
from megascale.config import JobConfig, from_dict
from megascale.model.gpt import GPT
from megascale.parallel.parallelize import parallelize
from megascale.parallel.tensor_parallel import shard_in_features, shard_out_features
from megascale.parallel.topology import Group, Layout, ParallelContext, groups_to_create

STEP = 3
GPT_TIED = {"arch": "gpt", "block": "parallel", "tied_embeddings": True}
LLAMA_GQA = {"arch": "llama", "kv_heads": 2}  # fused q|k|v with half as many k/v heads; fused gate|up


def job(model: dict, tp: int = 1, pp: int = 1, vpp: int = 1, dp: int = 1) -> JobConfig:
    return from_dict({
        "model": {"layers": 4, "hidden": 16, "heads": 4, "ffn": 24, "vocab": 32, "seq": 8, **model},
        # Tiny buckets: parameters straddle the DP cuts.
        "parallelism": {"tp": tp, "pp": pp, "vpp": vpp, "dp": dp, "grad_bucket_mb": 1e-3},
        "batch": {"micro": 1, "global": 4},
    })


class Rank:
    """One rank of a layout, built here: its optimizer holds master weights from the seed, and moments
    derived from them (2w and w^2), so every element's source is checkable."""

    def __init__(self, cfg: JobConfig, rank: int):
        p = cfg.parallelism
        layout = Layout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp)
        groups = {name: Group(ranks=members, rank=members.index(rank)) for name, members in
                  groups_to_create(layout, rank)}
        self.ctx = ParallelContext(layout=layout, rank=rank, device=torch.device("cpu"), **groups)
        with torch.device("meta"):
            model = GPT(cfg.model)
        _, self.optimizer = parallelize(model, self.ctx, cfg)
        self.optimizer.exp_avg.copy_(2 * self.optimizer.master)
        self.optimizer.exp_avg_sq.copy_(self.optimizer.master.square())
        self.plan = SavePlan({"optimizer": self.optimizer}, self.meta())
        self.layout = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "vpp": p.vpp}

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.ctx.pp.rank, self.ctx.tp.rank, self.ctx.dp.rank

    def meta(self) -> dict:
        pp, tp, dp = self.coords
        return {"step": STEP, "key": f"pp{pp}-tp{tp}-dp{dp}", "coords": [pp, tp, dp]}

    def image(self) -> HostBuffer:
        buffer = HostBuffer(self.plan.size)
        self.plan.write(buffer.bytes, *self.plan.capture(self.meta()), self.ctx.device)
        return buffer


def save(cfg: JobConfig) -> tuple[dict, dict]:
    """(manifest, {shard key: image}) of a checkpoint of every rank of `cfg`'s layout."""
    ranks = [Rank(cfg, r) for r in range(cfg.parallelism.world_size)]
    stages = [{"pp": r.ctx.pp.rank, "params": r.plan.sharded_params()} for r in ranks
              if r.ctx.tp.rank == 0 and r.ctx.dp.rank == 0]
    manifest = {"step": STEP, "layout": ranks[0].layout, "config": cfg.to_dict(), "parts": ["optimizer"],
                "tensors": tensor_table(stages)}
    return manifest, {r.meta()["key"]: r.image() for r in ranks}


def restore(manifest: dict, images: dict, cfg: JobConfig) -> list[tuple[Rank, object, list[str], float]]:
    """(rank, its restored ZeRO shard, the old shards it read, the share of their bytes it was sent)
    for every rank of `cfg`'s layout. After a layout change a DP group member sends each shard
    (member k % dp sends shard k), and only the byte ranges it finds the group needs."""
    ranks = [Rank(cfg, r) for r in range(cfg.parallelism.world_size)]
    sources = [slice_sources(manifest, rank.layout, rank.coords, rank.plan.sharded) for rank in ranks]
    assemblies = [Assembly(rank.plan, manifest, s, rank.ctx.tp.rank) for rank, s in zip(ranks, sources)]
    out = []
    for rank, assembly, mine in zip(ranks, assemblies, sources):
        group = {other.ctx.dp.rank: a for other, a in zip(ranks, assemblies) if other.ctx.dp.ranks == rank.ctx.dp.ranks}
        sent_bytes = 0
        for k, key in enumerate(mine.keys):
            ranges = group[k % len(group)].needed_ranges(k, images[key])
            sent_bytes += sum(end - begin for begin, end in ranges)
            sent = HostBuffer(images[key].size)
            for begin, end in ranges:
                sent.bytes[begin:end] = images[key].bytes[begin:end]
            assembly.add(k, STEP, *read_shard(sent.fd))
            sent.close()
        assert assembly.uncovered() is None
        share = sent_bytes / sum(images[key].size for key in mine.keys)
        out.append((rank, assembly.states()["optimizer"]["shard"], mine.keys, share))
    return out


def assert_restored(results) -> None:
    for rank, shard, *_ in results:
        master = rank.optimizer.master
        assert torch.equal(shard.tensors["master"], master), rank.ctx.describe()
        assert torch.equal(shard.tensors["exp_avg"], 2 * master), rank.ctx.describe()
        assert torch.equal(shard.tensors["exp_avg_sq"], master.square()), rank.ctx.describe()


@pytest.mark.parametrize("model", [GPT_TIED, LLAMA_GQA], ids=["gpt-tied", "llama-gqa"])
@pytest.mark.parametrize("new", [dict(tp=1, pp=4, dp=2), dict(tp=2, pp=1, dp=4), dict(), dict(tp=2, pp=2, dp=1)],
                         ids=["tp1pp4dp2", "tp2pp1dp4", "1rank", "tp2pp2vpp1dp1"])
def test_tp2_pp2_vpp2_dp2_state_restores_onto_another_layout(model, new):
    manifest, images = save(job(model, tp=2, pp=2, vpp=2, dp=2))
    try:
        results = restore(manifest, images, job(model, **new))
        assert_restored(results)
    finally:
        for image in images.values():
            image.close()
    if new == dict(tp=1, pp=4, dp=2):  # one old stage per new stage (vpp 2: stage 0 held layers 0 and 2)
        rank, _, read, share = results[0]
        assert read == ["pp0-tp0-dp0", "pp0-tp0-dp1", "pp0-tp1-dp0", "pp0-tp1-dp1"]
        assert share < 1  # of each, only the pieces of the stage's layers are sent


@pytest.mark.parametrize("model", [GPT_TIED, LLAMA_GQA], ids=["gpt-tied", "llama-gqa"])
def test_one_rank_state_restores_onto_tp2_and_onto_pp2(model):
    """1 -> 2 ranks: TP cuts what was whole; the last stage's tied output embedding comes from the
    input embedding, the only copy a one-stage checkpoint holds."""
    manifest, images = save(job(model))
    try:
        for new in (dict(tp=2), dict(pp=2)):
            results = restore(manifest, images, job(model, **new))
            assert_restored(results)
            assert all(read == ["pp0-tp0-dp0"] for _, _, read, _ in results)
    finally:
        for image in images.values():
            image.close()
    if model is GPT_TIED:
        assert "lm_head.weight" not in manifest["tensors"]["optimizer.shard"]


@pytest.mark.parametrize("old_parts, new_parts", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 3)])
@pytest.mark.parametrize("dim", [0, 1])
def test_any_piece_of_a_tp_slice_maps_to_its_place_in_another_tp_slice(old_parts, new_parts, dim):
    """Against the TP plan's own cutting: a fused weight's sections (dim 0), a row-parallel weight
    (dim 1, one interval per row: the vectorised copy)."""
    rows = (24, 12, 12) if dim == 0 else None  # q|k|v-like sections
    full = torch.randn(48, 90) if dim == 0 else torch.randn(90, 48)

    def held(parts: int, rank: int) -> torch.Tensor:
        group = SimpleNamespace(size=parts, rank=rank)
        cut = shard_out_features(full, group, rows) if dim == 0 else shard_in_features(full, group)
        return cut.detach().reshape(-1)

    for new_rank in range(new_parts):
        new = TPSlice.cut(full.shape, Split(dim, new_parts, rows), new_rank)
        expected = held(new_parts, new_rank)
        start, length = 7, expected.numel() - 20  # a ZeRO piece: some middle range, stored at 5
        out = torch.full((length + 5,), float("nan"))
        for old_rank in range(old_parts):
            old = TPSlice.cut(full.shape, Split(dim, old_parts, rows), old_rank)
            source = held(old_parts, old_rank)
            half = source.numel() // 2
            for piece_start, piece_length in ((0, half), (half, source.numel() - half)):
                padded = torch.cat([torch.zeros(3), source[piece_start:piece_start + piece_length]])
                copy_intervals([out], [padded], *overlaps(old, (piece_start, piece_length, 3), new,
                                                         (start, length, 5)))
        assert torch.equal(out[5:], expected[start:start + length])
