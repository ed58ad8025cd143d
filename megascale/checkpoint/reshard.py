"""Restoring onto another tp / pp / vpp: which old shards feed a rank, and where each element of an
old ZeRO piece goes in the new one.

A ZeRO piece is a range of a parameter flattened *as one TP rank holds it*. Two ranks' pieces are
compared through the parameter's full flattened index space: a TP rank's tensor is a handful of
contiguous runs of the full one (`runs`), found from the full shape and the split the manifest
records (tensor_parallel.shard_*: each section along `dim` cut into `parts` equal slices), so a
fused weight (q|k|v with GQA's fewer k/v heads, SwiGLU's gate|up) maps section by section. Pipeline
changes move whole parameters between ranks; names are global (blocks keyed by layer index), so
only the set of old stages to read changes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megascale.checkpoint.stateful import ShardedFlat, Split
from megascale.checkpoint.storage import CheckpointError, CorruptShard, shard_key

# A tied output embedding's copy on the last stage (pp > 1) has the name below; a checkpoint saved
# with pp = 1 holds only the input embedding it equals (GPT.init_value, parallelize.mark_tied_embeddings).
TIED_COPIES = {"lm_head.weight": "wte.weight"}


@dataclass(frozen=True)
class TPSlice:
    """What one TP rank holds of a parameter of full `shape`: slice `rank` of `parts` of every
    section along `dim`, the slices concatenated. parts = 1: the whole parameter."""

    shape: tuple[int, ...]
    dim: int = 0
    sections: Optional[tuple[int, ...]] = None
    parts: int = 1
    rank: int = 0

    @staticmethod
    def cut(shape: Sequence[int], split: Optional[Split], rank: int) -> TPSlice:
        shape = tuple(shape)
        if split is None or split.parts == 1:
            return TPSlice(shape)  # one canonical form, so equal cuts compare equal
        sections = tuple(split.sections) if split.sections else None
        return TPSlice(shape, split.dim, sections, split.parts, rank)

    @staticmethod
    def of_manifest(entry: dict, rank: int) -> TPSlice:
        """From a manifest `tensors` entry ({"shape", "split"}); `rank`: the old shard's TP rank."""
        split = entry["split"]
        return TPSlice.cut(entry["shape"], Split(split["dim"], split["parts"], split.get("sections")) if split
                           else None, rank)


@functools.lru_cache(maxsize=4096)
def runs(s: TPSlice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local starts, full starts, lengths): the TP rank's flattened tensor as contiguous runs of the
    full flattened parameter, in order (both starts increase)."""
    numel = math.prod(s.shape)
    if s.parts == 1:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([numel], np.int64)
    size = s.shape[s.dim]
    sections = np.array(s.sections or (size,), np.int64)
    if sections.sum() != size or (sections % s.parts).any():
        raise CorruptShard(f"a split of {s.parts} parts cannot cut sections {sections.tolist()} of a dim of {size}")
    outer, inner = math.prod(s.shape[:s.dim]), math.prod(s.shape[s.dim + 1:])
    width = sections // s.parts
    local_at = np.cumsum(width) - width
    full_at = np.cumsum(sections) - sections + s.rank * width
    rows = np.arange(outer, dtype=np.int64)[:, None]
    local = ((rows * (size // s.parts) + local_at) * inner).ravel()
    full = ((rows * size + full_at) * inner).ravel()
    length = np.broadcast_to(width * inner, (outer, len(sections))).ravel()
    # Merge runs contiguous on both sides (e.g. the slices of consecutive rows of a dim-0 split).
    joined = (local[1:] == local[:-1] + length[:-1]) & (full[1:] == full[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return local[starts], full[starts], np.add.reduceat(length, starts)


def _in_full(s: TPSlice, start: int, length: int, at: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Elements start..start+length of `s` (flattened), stored from position `at`, as intervals
    [lo, hi) of the full flattened parameter and the position each interval's first element has."""
    local, full, n = runs(s)
    first = np.searchsorted(local, start, side="right") - 1
    last = np.searchsorted(local, start + length, side="left")
    local, full, n = local[first:last], full[first:last], n[first:last]
    lo = np.maximum(local, start)
    hi = np.minimum(local + n, start + length)
    return full + lo - local, full + hi - local, at + lo - start


def overlaps(src: TPSlice, src_piece: tuple[int, int, int], dst: TPSlice, dst_piece: tuple[int, int, int],
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source positions, destination positions, lengths) of what an old piece (start, length, at)
    of `src` holds of a new piece of `dst`, as intervals."""
    if src.shape != dst.shape:
        raise CorruptShard(f"a parameter of shape {list(src.shape)} in the checkpoint is {list(dst.shape)} here")
    if src == dst:  # the same cut: local indices compare as they are
        (s, n, a), (t, m, b) = src_piece, dst_piece
        lo, hi = max(s, t), min(s + n, t + m)
        ok = lo < hi
        return (np.array([a + lo - s] if ok else [], np.int64), np.array([b + lo - t] if ok else [], np.int64),
                np.array([hi - lo] if ok else [], np.int64))
    x_lo, x_hi, x_at = _in_full(src, *src_piece)
    y_lo, y_hi, y_at = _in_full(dst, *dst_piece)
    # Both interval lists are sorted and disjoint: pair each x with the y intervals it meets.
    first = np.searchsorted(y_hi, x_lo, side="right")
    count = np.searchsorted(y_lo, x_hi, side="left") - first
    xi = np.repeat(np.arange(len(x_lo)), count)
    yi = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    lo, hi = np.maximum(x_lo[xi], y_lo[yi]), np.minimum(x_hi[xi], y_hi[yi])
    keep = lo < hi
    xi, yi, lo, hi = xi[keep], yi[keep], lo[keep], hi[keep]
    return x_at[xi] + lo - x_lo[xi], y_at[yi] + lo - y_lo[yi], hi - lo


def copy_intervals(dst: list[torch.Tensor], src: list[torch.Tensor], src_at: np.ndarray, dst_at: np.ndarray,
                   length: np.ndarray) -> None:
    """dst[k][d:d+n] = src[k][s:s+n] for every interval and every pair of flat tensors. Intervals
    repeating at a fixed stride (a row-split weight: one per row) are copied as one strided block."""
    src_at, dst_at, length = src_at.tolist(), dst_at.tolist(), length.tolist()
    i = 0
    while i < len(length):
        n, count = length[i], 1
        if i + 1 < len(length) and length[i + 1] == n:
            a, b = src_at[i + 1] - src_at[i], dst_at[i + 1] - dst_at[i]
            while (i + count < len(length) and length[i + count] == n and src_at[i + count] - src_at[i + count - 1] == a
                   and dst_at[i + count] - dst_at[i + count - 1] == b):
                count += 1
        else:
            a = b = n  # a single interval: any stride
        s, d = src_at[i], dst_at[i]
        for out, inp in zip(dst, src):
            block = out[d:d + b * (count - 1) + n].as_strided((count, n), (b, 1))
            block.copy_(inp[s:s + a * (count - 1) + n].as_strided((count, n), (a, 1)))
        i += count


# ---- which old shards -----------------------------------------------------------------------


@dataclass(frozen=True)
class Sources:
    """The old shards one rank restores from, as (pp, tp, dp) coordinates in reading order (the same
    on every member of its DP group). `own`: the one whose unsharded and per-rank state it takes.
    `same_cut`: the layout did not change, so its own old shard alone holds its ZeRO pieces."""

    coords: list[tuple[int, int, int]]
    own: int
    same_cut: bool

    @property
    def keys(self) -> list[str]:
        return [shard_key(*c) for c in self.coords]

    @property
    def replica_tp(self) -> int:
        """The old TP rank parameters that TP does not split are taken from (any would do)."""
        return self.coords[self.own][1]


def held_as(name: str, table: dict, tied: bool) -> str:
    """The name the checkpoint holds parameter `name` under."""
    return TIED_COPIES[name] if tied and name not in table and name in TIED_COPIES else name


def slice_sources(manifest: dict, layout: dict, coords: tuple[int, int, int], sharded: dict[str, ShardedFlat],
                  ) -> Sources:
    """The old shards holding what rank `coords` (pp, tp, dp) of `layout` needs (`sharded`: its
    ShardedFlats by id): every old DP shard of the old TP ranks whose slices meet its own, on the
    old stages its parameters were on. It takes per-rank state (random streams) from the old rank
    at its coordinates (same layout, or only DP changed; its DP index modulo the old DP size), or
    else from the first of those old TP ranks and stages."""
    old = manifest["layout"]
    pp, tp, dp = coords
    if all(old[k] == layout[k] for k in ("tp", "pp", "vpp")):
        return Sources([(pp, tp, j) for j in range(old["dp"])], dp % old["dp"], old["dp"] == layout["dp"])
    tied = bool(manifest["config"]["model"].get("tied_embeddings"))
    stages = set()
    for sid, flat in sharded.items():
        table = manifest["tensors"].get(sid, {})
        for name in flat.params:
            entry = table.get(held_as(name, table, tied))
            if entry is None:
                raise CheckpointError(f"checkpoint step {manifest['step']} holds no parameter {name} of {sid}")
            stages.add(entry["pp"][0])
    # TP rank t holds fraction [t/T, (t+1)/T) of every split section: the old ranks meeting this one's.
    first, end = tp * old["tp"] // layout["tp"], -(-(tp + 1) * old["tp"] // layout["tp"])
    cut = [(p, t, j) for p in sorted(stages) for t in range(first, end) for j in range(old["dp"])]
    return Sources(cut, cut.index((min(stages), first, dp % old["dp"])), False)


def describe(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "vpp", "dp"))
