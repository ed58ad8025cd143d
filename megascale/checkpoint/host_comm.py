"""Checkpoint traffic between ranks: small JSON values and shard images, all in host memory. On NCCL
jobs it runs on gloo groups of its own, never queued behind training's device collectives. Every
call is a no-op on one rank (or, for the DP calls, in a DP group of one)."""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megascale.checkpoint.host_buffer import HostBuffer
from megascale.parallel.topology import ParallelContext

RECORD_BYTES = 1024  # one rank's persist outcome, gathered to rank 0 as fixed-size JSON


class HostGroups:
    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.single = ctx.layout.world_size == 1
        if self.single or dist.get_backend() == "gloo":
            self.world, self.dp = None, ctx.dp.pg
        else:
            self.world = dist.new_group(backend="gloo")
            self.dp = dist.new_group(ctx.dp.ranks, backend="gloo", use_local_synchronization=True) \
                if ctx.dp.size > 1 else None

    def world_sum(self, values: list[int]) -> list[int]:
        if self.single:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, group=self.world)
        return t.tolist()

    def world_max(self, values: list[int]) -> list[int]:
        if self.single:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world)
        return t.tolist()

    def broadcast_json(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.single:
            return value
        data = json.dumps(value).encode() if self.ctx.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.world)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.ctx.rank == 0 else \
            torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.world)
        return json.loads(bytes(buf.numpy()))

    def gather_records(self, record: dict) -> list[dict]:
        """Every rank's small `record` on rank 0, by rank ([] elsewhere); a long "error" is cut."""
        if self.single:
            return [record]
        if "error" in record:
            record["error"] = record["error"][:RECORD_BYTES // 2]
        raw = json.dumps(record).encode().ljust(RECORD_BYTES)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(t) for _ in range(self.ctx.layout.world_size)] if self.ctx.rank == 0 else None
        dist.gather(t, out, dst=0, group=self.world)
        return [json.loads(bytes(o.numpy())) for o in out] if out else []

    def gather_json(self, value: Optional[Any]) -> list[Any]:
        """On rank 0, the values of the ranks that passed one (any size), by rank; [] elsewhere."""
        data = b"" if value is None else json.dumps(value).encode()
        if self.single:
            return [value] if value is not None else []
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(n) for _ in range(self.ctx.layout.world_size)] if self.ctx.rank == 0 else None
        dist.gather(n, sizes, dst=0, group=self.world)
        if self.ctx.rank != 0:
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=self.world)
            return []
        out = [value] if data else []
        for rank, size in enumerate(sizes[1:], start=1):
            if int(size):
                buf = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(buf, src=rank, group=self.world)
                out.append(json.loads(bytes(buf.numpy())))
        return out

    def dp_all_gather(self, value: int) -> list[int]:
        if self.ctx.dp.size == 1:
            return [value]
        t = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.ctx.dp.size)]
        dist.all_gather(out, t, group=self.dp)
        return [int(o) for o in out]

    def dp_broadcast(self, image: Optional[HostBuffer], source: int,
                     keep: Optional[Callable[[HostBuffer], list[tuple[int, int]]]] = None,
                     buffer: Callable[[int], HostBuffer] = HostBuffer) -> Optional[HostBuffer]:
        """The source member's shard image on every member (the others' in a `buffer(size)` each);
        None everywhere if the source had none, or `keep` found it unusable. `keep(image)`: the byte
        ranges the members will read, the only ones sent (the rest of their buffers is left as it
        was), or None if the image is unusable; no `keep`: all of it."""
        if self.ctx.dp.size == 1:
            return image
        src = self.ctx.dp.ranks[source]
        mine = source == self.ctx.dp.rank
        ranges = ([(0, image.size)] if keep is None else keep(image)) if mine and image is not None else None
        n = torch.tensor([image.size if ranges is not None else -1, len(ranges or ())], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.dp)
        size, count = n.tolist()
        if size < 0:
            return None
        bounds = torch.tensor(ranges, dtype=torch.int64) if mine else torch.empty((count, 2), dtype=torch.int64)
        dist.broadcast(bounds, src=src, group=self.dp)
        if not mine:
            image = buffer(size)
        for begin, end in bounds.tolist():  # straight between the members' buffers: no packing
            dist.broadcast(image.bytes[begin:end], src=src, group=self.dp)
        return image
