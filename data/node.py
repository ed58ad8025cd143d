"""What a node's loader and its ranks agree on without talking: who reads, and the shared-memory layout.

Shared memory is one memfd (an anonymous file: nothing is ever created under /dev/shm), sent to
the ranks over a Unix socket in Linux's abstract namespace (no file either). Both vanish when the
last process holding them exits, kill -9 included, so there is nothing to leak or unlink.

    [header 4 KiB: stats]  [slot 0] ... [slot depth-1]
    slot = [stamp: gen, batch]  then per DP rank of the node: tokens int32, doc ids int64,
           positions int32, each [microbatches*micro, seq+1]
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import numpy as np
from megascale.data import DataError

HEADER_BYTES = 4096
STAMP_BYTES = 64
STATS = ("bytes_read", "windows_loaded", "batches", "loader_pid", "idle")  # int64 each, written by the loader
ALIGN = 64


@dataclass(frozen=True)
class NodePlan:
    node: int
    consumers: tuple[int, ...]  # global ranks of this node that copy batches (first/last PP stage)
    local_dps: tuple[int, ...]  # DP ranks those consumers belong to: what the loader produces

    @property
    def leader(self) -> int | None:
        """The rank that starts the node's loader process: its lowest consumer."""
        return self.consumers[0] if self.consumers else None


def coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank): TP innermost, then DP, then PP, as the engine lays ranks out."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def node_plan(global_rank: int, ranks_per_node: int, tp: int, dp: int, pp: int) -> NodePlan:
    world = tp * dp * pp
    node = global_rank // ranks_per_node
    ranks = range(node * ranks_per_node, min(world, (node + 1) * ranks_per_node))
    # Middle pipeline stages never look at tokens, so they are not consumers and cost no copy.
    consumers = tuple(r for r in ranks if coords(r, tp, dp)[2] in (0, pp - 1))
    return NodePlan(node, consumers, tuple(sorted({coords(r, tp, dp)[1] for r in consumers})))


@dataclass(frozen=True)
class Layout:
    depth: int  # batches buffered ahead (data.prefetch)
    dps: int  # DP ranks served by this node
    rows: int  # sequences per DP rank per step: microbatches * micro
    seq: int

    @property
    def block_bytes(self) -> int:
        return _aligned(self.rows * (self.seq + 1) * 16)  # int32 token + int64 doc + int32 position

    @property
    def slot_bytes(self) -> int:
        return STAMP_BYTES + self.dps * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.depth * self.slot_bytes

    def stamp(self, buf, slot: int) -> np.ndarray:
        return np.frombuffer(buf, dtype=np.int64, count=2, offset=HEADER_BYTES + slot * self.slot_bytes)

    def stats(self, buf) -> np.ndarray:
        return np.frombuffer(buf, dtype=np.int64, count=len(STATS), offset=0)

    def block(self, buf, slot: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, doc ids, positions) views of local DP rank j's rows in a slot."""
        shape, n = (self.rows, self.seq + 1), self.rows * (self.seq + 1)
        at = HEADER_BYTES + slot * self.slot_bytes + STAMP_BYTES + j * self.block_bytes
        tokens = np.frombuffer(buf, dtype=np.int32, count=n, offset=at).reshape(shape)
        docs = np.frombuffer(buf, dtype=np.int64, count=n, offset=at + 4 * n).reshape(shape)
        pos = np.frombuffer(buf, dtype=np.int32, count=n, offset=at + 12 * n).reshape(shape)
        return tokens, docs, pos


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LoaderConfig:
    """Everything the node's loader process needs; every consumer derives the same one."""

    dataset: str
    dataset_fingerprint: str
    seed: int
    window: int
    seq: int
    rows: int  # per DP rank per step
    batch_sequences: int  # per step, all DP ranks: dp * rows
    depth: int
    local_dps: tuple[int, ...]
    consumers: tuple[int, ...]
    socket: str
    connect_timeout: float
    holdout: float = 0.0  # eval.split: this share of the documents is never trained on

    @property
    def layout(self) -> Layout:
        return Layout(self.depth, len(self.local_dps), self.rows, self.seq)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoaderConfig:
        raw = json.loads(text)
        return cls(**{**raw, "local_dps": tuple(raw["local_dps"]), "consumers": tuple(raw["consumers"])})


def socket_name(run_dir: str, node: int) -> str:
    """Abstract socket name, unique per (run directory, job, node) on this machine."""
    job = (os.environ.get("MEGASCALE_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
           or os.environ.get("SLURM_JOB_ID", ""))
    key = f"{os.path.realpath(run_dir)}|{job}|{node}"
    return "megascale-data-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def check_platform() -> None:
    if not hasattr(os, "memfd_create"):
        raise DataError("the node data loader needs Linux (memfd_create, abstract Unix sockets)")
