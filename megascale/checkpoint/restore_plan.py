"""Restore planning: which old shards a rank needs (reshard.py), who reads each (one reader per DP
group, or the member that still holds it in host memory), the reads themselves (`SliceReader`), and
how the shards' contents become this rank's part states (`Assembly`).

A checkpoint restores onto any tp / pp / vpp / dp. Same layout: each rank needs only its own old
shard. Only dp changed: every old DP shard of its (pp, tp) slice. Otherwise every old DP shard of
the old (stage, TP rank) slices holding its parameters; one member of the DP group reads each and
sends the group only the parts it needs, and a ShardedFlat's pieces are mapped element by element
through the parameters' full shapes and TP splits, which the manifest records (reshard.py).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megascale.checkpoint.client import KeeperLink
from megascale.checkpoint.host_buffer import HostBuffer
from megascale.checkpoint.host_comm import HostGroups
from megascale.checkpoint.reshard import Sources, TPSlice, copy_intervals, held_as, overlaps
from megascale.checkpoint.save_plan import SHARDED, TENSOR, SavePlan, check_header
from megascale.checkpoint.shard_format import read_shard, tensor_places
from megascale.checkpoint.stateful import ShardedFlat
from megascale.checkpoint.storage import (
    VERSION, CorruptShard, Storage, checksum, chunks_of, read_verified, shard_key, step_dir,
)

log = logging.getLogger("megascale.checkpoint")


def interrupted_step(records: list[dict], layout: dict) -> Optional[int]:
    """The step every rank's keeper persisted (`records`: their snapshots, by rank) if they all hold
    the same one, in this format, for exactly this layout's shards; else None."""
    expected = {shard_key(p, t, d) for p in range(layout["pp"]) for t in range(layout["tp"])
                for d in range(layout["dp"])}
    steps = {r.get("step") for r in records}
    if len(steps) != 1 or None in steps or {r["key"] for r in records} != expected \
            or any(r["state"] != "persisted" or r.get("version") != VERSION for r in records):
        return None
    return steps.pop()


def plan_reads(count: int, me: int, dp: int, holders: list[int], same_cut: bool, every_rank_reads: bool = False,
               ) -> list[tuple[int, Any, bool]]:
    """(old shard index, who provides it: "self" or a DP member, whether this rank needs it), in the
    same order on every member of the DP group; `holders[i]`: the old shard member i has in host memory.

    Same cut (the layout did not change): member j needs only old shard j, so it reads it itself,
    unless another member holds it in memory and sends it. Otherwise a shard may feed every member:
    one member provides it (one holding it in memory, else member k % dp) and broadcasts it to the group.
    `every_rank_reads` (benchmark baseline only): every rank reads every shard it needs itself."""
    if every_rank_reads:
        return [(k, "self", True) for k in range(count)]
    plan = []
    for k in range(count):
        source = holders.index(k) if k in holders else k % dp
        if same_cut and source == k:
            if k == me:
                plan.append((k, "self", True))
            continue
        plan.append((k, source, not same_cut or k == me))
    return plan


class SliceReader:
    """Reads the old shards one rank restores from (`sources`), each from the keeper's intact host
    snapshot, from storage, or from the DP member that read it; counts where they came from."""

    def __init__(self, storage: Storage, comm: HostGroups, manifest: dict, sources: Sources,
                 every_rank_reads: bool = False):
        self.storage, self.comm, self.manifest, self.every_rank_reads = storage, comm, manifest, every_rank_reads
        self.rank = comm.ctx.rank
        self.sources = sources
        self.keys = sources.keys
        self.bytes_read = 0  # shard bytes read from storage
        self.restored_from: dict[str, int] = {}
        self.into: Optional[HostBuffer] = None  # see `load`
        self.spare: Optional[HostBuffer] = None  # a shard image's buffer, done with: the next one reuses it

    def held(self, link: KeeperLink) -> tuple[int, Optional[HostBuffer]]:
        """(index in `keys`, image) of the old shard the keeper holds intact, if this rank needs it;
        else (-1, None)."""
        manifest, snap = self.manifest, link.snapshot
        if any(key not in manifest["shards"] for key in self.keys):
            return -1, None
        if not snap or snap.get("state") != "persisted" or snap["key"] not in self.keys:
            return -1, None
        entry = manifest["shards"][snap["key"]]
        if snap["step"] != manifest["step"] or (snap["crc32"], snap["length"]) != (entry["crc32"], entry["bytes"]):
            log.info("rank %d: host snapshot is of step %d, the checkpoint is step %d; reading storage",
                     self.rank, snap["step"], manifest["step"])
            return -1, None
        image = HostBuffer(link.snapshot_size, fd=link.take_snapshot_fd())
        link.snapshot = None
        if (snap["offset"], snap["length"]) != (0, image.size) \
                or checksum(chunks_of(memoryview(image.bytes.numpy()))) != entry["crc32"]:
            log.warning("rank %d: host snapshot of step %d fails its checksum; reading storage",
                        self.rank, manifest["step"])
            image.close()
            return -1, None
        return self.keys.index(snap["key"]), image

    def load(self, plan: SavePlan, held: int, image: Optional[HostBuffer], into: Optional[HostBuffer] = None,
             ) -> tuple[Optional[Assembly], Optional[str]]:
        """Collective over the DP group: this rank's part states (as planned by `plan`) from the old
        shards, or what went wrong. `image` is old shard `held`, from host memory; `into`, a buffer the
        caller keeps, takes the first shard read from storage that fits it (memfd pages are slow to
        allocate: the save buffer, allocated anyway, spares a second one)."""
        manifest, keys, ctx = self.manifest, self.keys, self.comm.ctx
        self.into = into
        missing = [key for key in keys if key not in manifest["shards"]]
        if missing:
            return None, f"manifest lacks shard {missing[0]}"
        step = manifest["step"]
        assembly = Assembly(plan, manifest, self.sources, ctx.tp.rank)
        reads = plan_reads(len(keys), ctx.dp.rank, ctx.dp.size, self.comm.dp_all_gather(held),
                           self.sources.same_cut, self.every_rank_reads)
        try:
            for k, source, needed in reads:
                data, error = None, None
                if source in ("self", ctx.dp.rank):
                    data, error = (image, None) if held == k else self._read(step, manifest["shards"][keys[k]])
                    if data is not None:
                        where = "host memory" if held == k else "storage"
                        self.restored_from[where] = self.restored_from.get(where, 0) + 1
                if source != "self":  # after a layout change only what the group needs of it is sent
                    read, unusable = data, []
                    keep = None if self.sources.same_cut else lambda image, k=k: self._needed(
                        assembly, k, image, unusable)
                    data = self.comm.dp_broadcast(data, source, keep, self._buffer)
                    if unusable:  # the source's own read, sent to no one
                        error = unusable[0]
                        if read is not image and read is not into:
                            self._recycle(read)
                if data is None:
                    return None, error or f"shard {keys[k]} failed on DP rank {source} (see its log)"
                try:
                    if needed:
                        meta, tensors = read_shard(data.fd)
                        check_header(meta, tensors)
                        assembly.add(k, step, meta, tensors)
                except CorruptShard as e:
                    return None, f"{keys[k]}: {e}"
                finally:
                    if data is not image and data is not into:
                        self._recycle(data)
        finally:
            if self.spare is not None:
                self.spare.close()
                self.spare = None
        uncovered = assembly.uncovered()
        return (None, uncovered) if uncovered else (assembly, None)

    def _needed(self, assembly: Assembly, k: int, image: HostBuffer, unusable: list[str]
                ) -> Optional[list[tuple[int, int]]]:
        """The byte ranges of old shard `k` its DP group reads; None (the group gets no image, so
        every member falls back together) if its header is malformed, and why in `unusable`."""
        try:
            return assembly.needed_ranges(k, image)
        except CorruptShard as e:
            unusable.append(f"{self.keys[k]}: {e}")
            log.error("rank %d: %s", self.rank, unusable[0])
            return None

    def _buffer(self, size: int) -> HostBuffer:
        """A host buffer for one shard image: the last one done with if it fits (fresh pages are slow)."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.size == size:
            return spare
        if spare is not None:
            spare.close()
        return HostBuffer(size)

    def _recycle(self, buffer: HostBuffer) -> None:
        if self.spare is not None:
            self.spare.close()
        self.spare = buffer

    def _read(self, step: int, entry: dict) -> tuple[Optional[HostBuffer], Optional[str]]:
        kept = self.into is not None and self.into.size == entry["bytes"]
        data = self.into if kept else self._buffer(entry["bytes"])
        self.into = None if kept else self.into
        try:
            read_verified(self.storage, self.storage.path(step_dir(step), entry["file"]),
                          memoryview(data.bytes.numpy()), entry["crc32"])
        except (CorruptShard, OSError) as e:
            if not kept:
                data.close()
            log.error("rank %d: %s", self.rank, e)
            return None, str(e)
        self.bytes_read += entry["bytes"]
        return data, None


class _Target:
    """One of this rank's ShardedFlats, filled piece by piece from old shards of any layout."""

    def __init__(self, flat: ShardedFlat, tp_rank: int, table: dict, tied: bool):
        """`table`: the manifest's record of the old parameters (full shape, TP split)."""
        tensors = {key: torch.zeros(t.numel(), dtype=t.dtype) for key, t in flat.tensors.items()}
        self.flat = ShardedFlat(tensors, flat.pieces, flat.params)
        self.table = table
        # By the name the checkpoint holds each parameter under: (this rank's cut of it, start, length, at).
        self.slots: dict[str, list[tuple[TPSlice, int, int, int]]] = {}
        for name, start, length, at in flat.pieces:
            cut = TPSlice.cut(flat.params[name].shape, flat.params[name].split, tp_rank)
            self.slots.setdefault(held_as(name, table, tied), []).append((cut, start, length, at))
        # What every member of the DP group holds some of (each its own ZeRO range), by the same names.
        self.group_params = {held_as(name, table, tied) for name in flat.params}
        self.covered = 0

    def wants(self, name: str, tp_rank: int, replica_tp: int) -> bool:
        """Whether this rank's DP group takes parameter `name` from a shard of old TP rank `tp_rank`: if
        its members hold the parameter, and one TP did not split only from old TP rank `replica_tp`
        (each element is taken once)."""
        if name not in self.group_params:
            return False
        if name not in self.table:
            raise CorruptShard(f"the manifest does not record parameter {name}")
        return self.table[name]["split"] is not None or tp_rank == replica_tp

    def fill(self, saved: dict, tensors: dict[str, torch.Tensor], tp_rank: int, replica_tp: int) -> None:
        """Copies what `saved` (the $sharded entry of a shard of old TP rank `tp_rank`) holds of this
        rank's pieces."""
        keys = list(self.flat.tensors)
        out = [self.flat.tensors[key] for key in keys]
        source = [tensors[saved["tensors"][key]] for key in keys]
        for name, start, length, at in saved["pieces"]:
            if name not in self.slots or not self.wants(name, tp_rank, replica_tp):
                continue
            old = TPSlice.of_manifest(self.table[name], tp_rank)
            for cut, new_start, new_length, new_at in self.slots[name]:
                src_at, dst_at, n = overlaps(old, (start, length, at), cut, (new_start, new_length, new_at))
                copy_intervals(out, source, src_at, dst_at, n)
                self.covered += int(n.sum())


class Assembly:
    """This rank's part states, gathered from the old shards it restores from (`sources`):
    ShardedFlats piece by piece from all of them, everything else from its `own` old shard."""

    def __init__(self, plan: SavePlan, manifest: dict, sources: Sources, tp_rank: int):
        self.sources, self.parts = sources, list(plan.tree)
        tables, tied = manifest["tensors"], bool(manifest["config"]["model"].get("tied_embeddings"))
        self.targets = {sid: _Target(flat, tp_rank, tables.get(sid, {}), tied) for sid, flat in plan.sharded.items()}
        self.mine: Optional[tuple[dict, dict]] = None  # (parts tree, its tensors) of the own old shard

    def add(self, k: int, step: int, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Takes in old shard `k` of `sources` (its header's metadata and tensors)."""
        key, coords = self.sources.keys[k], list(self.sources.coords[k])
        if meta.get("step") != step or meta.get("key") != key or meta.get("coords") != coords:
            raise CorruptShard(f"shard header says step {meta.get('step')} {meta.get('key')}, "
                               f"expected step {step} {key}")
        tree = meta.get("parts")
        lacking = [name for name in self.parts if not isinstance(tree, dict) or name not in tree]
        if lacking:
            raise CorruptShard(f"shard {key} holds no state for {lacking[0]!r}")
        saved = {}
        _walk(tree, lambda node: saved.update({node[SHARDED]["id"]: node[SHARDED]}) if SHARDED in node else None)
        for sid, target in self.targets.items():
            if sid not in saved:
                raise CorruptShard(f"shard {key} holds no {sid}")
            try:
                target.fill(saved[sid], tensors, coords[1], self.sources.replica_tp)
            except KeyError as e:
                raise CorruptShard(f"shard {key} holds no tensor {e} of {sid}") from None
        if k == self.sources.own:
            self.mine = (tree, _small_tensors(tree, tensors))  # copies: the image's memory is reused

    def needed_ranges(self, k: int, image: HostBuffer) -> list[tuple[int, int]]:
        """The byte ranges of old shard `k`'s image this rank's DP group reads (its members hold the
        same parameters, each a different ZeRO range of them): the header, the state outside
        ShardedFlats, and the pieces of the parameters the group takes from it."""
        meta, data, places = tensor_places(memoryview(image.bytes.numpy()))
        check_header(meta, places)
        saved: dict = {}
        _walk(meta.get("parts"), lambda node: saved.update({node[SHARDED]["id"]: node[SHARDED]})
              if SHARDED in node else None)
        flat_tensors = {name for entry in saved.values() for name in entry["tensors"].values()}
        ranges = [(0, data)] + [(begin, end) for name, (begin, end, _) in places.items() if name not in flat_tensors]
        tp_rank = self.sources.coords[k][1]
        for sid, entry in saved.items():
            target = self.targets.get(sid)
            for name, start, length, at in entry["pieces"]:
                if target is not None and target.wants(name, tp_rank, self.sources.replica_tp):
                    for tensor in entry["tensors"].values():
                        begin, _, size = places[tensor]
                        ranges.append((begin + at * size, begin + (at + length) * size))
        merged: list[tuple[int, int]] = []
        for begin, end in sorted(ranges):
            if merged and begin <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((begin, end))
        return merged

    def uncovered(self) -> Optional[str]:
        """What of this rank's state no shard provided, if anything."""
        for sid, target in self.targets.items():
            if target.covered != target.flat.numel:
                return f"{sid}: the shards cover {target.covered} of this rank's {target.flat.numel} values"
        if self.mine is None:
            return f"shard {self.sources.keys[self.sources.own]} was not read"
        return None

    def states(self) -> dict[str, dict]:
        """The state each part loads."""
        flats = {sid: target.flat for sid, target in self.targets.items()}
        tree, tensors = self.mine
        return {name: _unflatten(tree[name], tensors, flats) for name in self.parts}


def _walk(node: Any, visit) -> None:
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _walk(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk(value, visit)


def _small_tensors(tree: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the tensors the tree names outside its ShardedFlats."""
    names: list[str] = []
    _walk(tree, lambda node: names.append(node[TENSOR]) if TENSOR in node else None)
    try:
        return {name: tensors[name].clone() for name in names}
    except KeyError as e:
        raise CorruptShard(f"the shard header names tensor {e} but holds none") from None


def _unflatten(node: Any, tensors: dict[str, torch.Tensor], flats: dict[str, ShardedFlat]) -> Any:
    if isinstance(node, dict):
        if TENSOR in node:
            return tensors[node[TENSOR]]
        if SHARDED in node:
            return flats[node[SHARDED]["id"]]
        return {k: _unflatten(v, tensors, flats) for k, v in node.items()}
    if isinstance(node, list):
        return [_unflatten(v, tensors, flats) for v in node]
    return node
