"""Rank coordinates and group membership, pure arithmetic without torch (the driver localises hangs with it).

Rank order is TP innermost (inside one node), then DP, then PP outermost, so TP
traffic stays on a node and DP groups are built within a PP stage (MegaScale §2).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def tp_members(self, rank: int) -> list[int]:
        _, d, p = self.coords_of(rank)
        return [self.rank_of(t, d, p) for t in range(self.tp)]

    def dp_members(self, rank: int) -> list[int]:
        t, _, p = self.coords_of(rank)
        return [self.rank_of(t, d, p) for d in range(self.dp)]

    def pp_members(self, rank: int) -> list[int]:
        t, d, _ = self.coords_of(rank)
        return [self.rank_of(t, d, p) for p in range(self.pp)]

    def embedding_members(self, rank: int) -> list[int]:
        """First and last stage of this rank's pipeline share tied embeddings; a middle
        stage is in no such group (it gets a group of itself)."""
        members = self.pp_members(rank)
        ends = sorted({members[0], members[-1]})
        return ends if rank in ends else [rank]


def groups_to_create(layout: Layout, rank: int) -> list[tuple[str, list[int]]]:
    """The groups this rank belongs to, in creation order.

    Each rank creates only its own groups with group-local synchronisation, so it
    waits on its group peers and never on a global barrier (MegaScale §3.5).
    """
    return [
        ("tp", layout.tp_members(rank)),
        ("dp", layout.dp_members(rank)),
        ("pp", layout.pp_members(rank)),
        ("pp_forward", layout.pp_members(rank)),
        ("pp_backward", layout.pp_members(rank)),
        ("embedding", layout.embedding_members(rank)),
    ]
