"""In-memory snapshots every `checkpoint.memory_every` steps, replicated to the next node (Gemini, SOSP '23).

Between persisted checkpoints (`checkpoint.every`) a rank copies its state into its host buffer (the one
phase 1 fills, shared with the node's keeper) and asks the keeper to `hold` it: the keeper checksums it and
sends it to the next node's keeper in ring order (replica.py) while training goes on; nothing is persisted.
The buffer holds one snapshot, so a rank waits for the keeper to have read the previous one before writing
the next, and takes none while a persisted checkpoint is still being written from it.

`restore` takes the newest step every rank holds intact, in its own node's keeper (the buffer, or one of
the keeper's copies of the rank's last two held snapshots) or as the replica its ring successor holds,
if it is no older than the newest committed checkpoint; the ranks agree on it through rank 0, as on a
committed checkpoint. Only onto the same layout and job settings (`digest`): any other resume restores
from storage and reshards.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import secrets
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Optional

from megascale.checkpoint.client import KeeperGone, KeeperLink
from megascale.checkpoint.host_buffer import HostBuffer
from megascale.checkpoint.host_comm import HostGroups
from megascale.checkpoint.replica import ReplicaError, fetch_replica, node_address, stat_replica
from megascale.checkpoint.reshard import Sources
from megascale.checkpoint.restore_plan import Assembly
from megascale.checkpoint.save_plan import SavePlan, check_header, tensor_table
from megascale.checkpoint.shard_format import read_shard
from megascale.checkpoint.storage import VERSION, CheckpointError, CorruptShard, checksum, chunks_of
from megascale.common import auth

if TYPE_CHECKING:
    from megascale.checkpoint.checkpointer import Checkpointer

log = logging.getLogger("megascale.checkpoint")
BUDGET = 0.02  # the share of training time snapshots may cost when the interval is left unset
WARMUP_STEPS = 3  # not measured: the first steps allocate, compile and fill caches
SAMPLES = 3  # snapshots measured (at interval 1) before an unset interval is decided
TAKEN_KEPT = 100  # the newest snapshot steps remembered (tests and logs look at them)
KEY_CONTEXT = b"megascale checkpoint replicas"


def auto_interval(step_s: float, copy_s: float, transfer_s: float, budget: float = BUDGET) -> int:
    """The smallest interval (steps) at which snapshots cost at most `budget` of training time: each
    blocks training for `copy_s`, and the keeper must have sent it (`transfer_s`, in the background)
    before the next one overwrites the buffer, or training waits for the rest."""
    return max(1, math.ceil(copy_s / (budget * step_s) - 1e-9), math.ceil(transfer_s / step_s - 1e-9))


def cost(every: int, step_s: float, copy_s: float, transfer_s: float) -> float:
    """The share of training time snapshots every `every` steps cost."""
    span = every * step_s
    return (copy_s + max(0.0, transfer_s - span)) / span


def snapshot_digest(config: dict, layout: dict, plan: SavePlan) -> str:
    """What a snapshot must match to be restored without a manifest: the layout, the tensors and the
    settings that give them meaning (a job resumed with other ones restores from storage)."""
    tensors = [[e.name, str(e.dtype), list(e.shape)] for e in plan.entries]
    sections = {k: config[k] for k in ("model", "optimizer", "batch", "data")}
    text = json.dumps({"layout": layout, "tensors": tensors, **sections}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def replica_key(comm: HostGroups) -> bytes:
    """The key keepers authenticate replicas with: derived from the job's secret when it has one
    ($MEGASCALE_SECRETS; never sent anywhere), else a random one rank 0 makes for this start and sends
    the ranks (a job without secrets authenticates none of its traffic)."""
    found = auth.from_env()
    if found is not None:
        return hmac.new(bytes.fromhex(found.hmac_key), KEY_CONTEXT, hashlib.sha256).digest()
    return bytes.fromhex(comm.broadcast_json(secrets.token_hex(32) if comm.ctx.rank == 0 else None))


class MemorySnapshots:
    """A Checkpointer's in-memory snapshots: taking them, their interval, restoring from them."""

    def __init__(self, owner: Checkpointer):
        """Collective: hands the node's keeper the replica key and learns the ring of keepers."""
        self.ck, self.rank = owner, owner.ctx.rank
        chosen = owner.cfg.checkpoint.memory_every
        self.explicit, self.every, self.decided = chosen is not None, chosen or 1, False
        self.reading: Optional[int] = None  # the step the keeper is still reading from the buffer
        # Bounded: a job snapshots for weeks. The measurements stop once the interval is decided.
        self.taken: deque[int] = deque(maxlen=TAKEN_KEPT)  # the newest steps snapshotted
        self.copies: list[float] = []  # seconds each measured snapshot's copy blocked training
        self.transfers: list[float] = []  # seconds the keeper took to checksum and send each
        self.step_times: list[float] = []  # seconds between snapshots' calls, without the checkpointer's own
        self.calls, self.left = 0, None
        self.note: Optional[str] = None  # the interval decision, as rank 0 logs it
        self.replica_error: Optional[str] = None
        self.restored_from: dict[str, int] = {}
        self.fetched_bytes = 0  # snapshot bytes the last restore fetched from the peer
        self.key = replica_key(owner.comm)
        self.bind, self.port = node_address(), 0
        self.address = self.listen(owner.link) if owner.link is not None else None
        self.peer = self._ring()

    def listen(self, link: KeeperLink) -> Optional[str]:
        """Has the node's keeper serve replicas (a restarted one on the same port); its address."""
        try:
            link.send({"op": "listen", "bind": self.bind, "port": self.port, "key": self.key.hex()})
            while (msg := link.recv(timeout=None)[0])["op"] not in ("listening", "error"):
                self.ck._on_message(msg)
        except CheckpointError as e:
            msg = {"error": str(e)}
        if "address" not in msg:
            log.warning("rank %d: snapshots stay on this node, unreplicated: %s", self.rank, msg["error"])
            return None
        self.port = int(msg["address"].rsplit(":", 1)[1])
        return msg["address"]

    def _ring(self) -> Optional[str]:
        """Collective: the keeper this node's snapshots go to, which holds this rank's replica: the next
        node's, nodes (their keepers) ordered by their first rank; None with one node."""
        found = self.ck.comm.gather_json({"address": self.address})
        ring = None
        if self.rank == 0:
            order = list(dict.fromkeys(r["address"] for r in found if r["address"]))
            ring = {a: order[(i + 1) % len(order)] for i, a in enumerate(order)} if len(order) > 1 else {}
        return self.ck.comm.broadcast_json(ring).get(self.address)

    # ---- taking them --------------------------------------------------------------------

    def after_step(self, step: int, arrived: float) -> None:
        """After each step (`arrived`: when the checkpointer was called): a snapshot if one is due and no
        persisted checkpoint is still being written from the buffer; the interval once measured."""
        self.calls += 1
        if self.left is not None and self.calls > WARMUP_STEPS and not self.decided:
            self.step_times.append(arrived - self.left)
        if step % self.every == 0 and self.ck.pending is None:  # `pending` is the same on every rank
            self.snapshot(step)
        if not self.decided and len(self.copies) >= (1 if self.explicit else SAMPLES):
            self._decide()
        self.left = time.perf_counter()

    def snapshot(self, step: int) -> None:
        """Copies the parts' state into the host buffer and has the keeper hold it and send it on."""
        ck, started = self.ck, time.perf_counter()
        self.settle()
        waited = time.perf_counter() - started
        try:
            header, tensors = ck.plan.capture(ck._meta(step))
            buffer = ck._ensure_buffer()
            ck.plan.write(buffer.bytes, header, tensors, ck.ctx.device)
            ck._connect().send(self._hold_message(step))
            self.reading = step
            self.taken.append(step)
        except KeeperGone as e:
            ck._keeper_lost(str(e))
        except (CheckpointError, OSError) as e:  # this snapshot is lost; training goes on
            log.warning("rank %d: in-memory snapshot of step %d failed: %s: %s", self.rank, step, type(e).__name__, e)
        if self.calls > WARMUP_STEPS and not self.decided:  # every rank alike, failed or not: `_decide` is collective
            self.copies.append(time.perf_counter() - started - waited)

    def _hold_message(self, step: int) -> dict:
        ck = self.ck
        return {"op": "hold", "rank": self.rank, "step": step, "key": ck.key, "coords": list(ck.coords),
                "version": VERSION, "length": ck.plan.size, "digest": ck.digest, "peer": self.peer}

    def on_held(self, msg: dict) -> None:
        """The keeper's report on the snapshot it was reading (op "held", or "error")."""
        self.reading = None
        if "seconds" in msg and not self.decided:
            self.transfers.append(msg["seconds"])
        error = msg.get("error")
        if error and error != self.replica_error:
            log.warning("rank %d: in-memory snapshot of step %d not replicated to %s: %s", self.rank, msg["step"],
                        self.peer, error)
        elif self.replica_error and not error:
            log.info("rank %d: in-memory snapshots replicate to %s again", self.rank, self.peer)
        self.replica_error = error

    def settle(self) -> None:
        """Waits until the keeper has read (checksummed, sent) the last snapshot: the buffer is free."""
        if self.reading is not None:
            self.ck._drain(until=lambda: self.reading is None)

    def _decide(self) -> None:
        """Collective: the interval, from what snapshots cost on the slowest rank after warm-up; rank 0 says so."""
        self.settle()  # the last sample's transfer time
        self.decided = True
        measured = [statistics.median(self.step_times) if self.step_times else 0.0, statistics.median(self.copies),
                    statistics.median(self.transfers) if self.transfers else 0.0]
        step_s, copy_s, transfer_s = (v / 1e6 for v in self.ck.comm.world_max([round(v * 1e6) for v in measured]))
        if step_s <= 0:
            return
        best = auto_interval(step_s, copy_s, transfer_s)
        spent = cost(self.every, step_s, copy_s, transfer_s)
        level = logging.INFO
        if self.explicit:
            self.note = f"checkpoint.memory_every: {self.every} costs {spent:.1%} of a {step_s:.3g} s step"
            if spent > BUDGET:
                self.note += f", over the {BUDGET:.0%} budget ({best} would be within it); kept as set"
                level = logging.WARNING
        elif best > 1:
            self.note = f"checkpoint.memory_every: 1 would cost {spent:.1%} of a {step_s:.3g} s step; using {best}"
            self.every, level = best, logging.WARNING
        else:
            self.note = f"checkpoint.memory_every: 1 (a snapshot costs {spent:.1%} of a {step_s:.3g} s step)"
        if self.rank == 0:
            log.log(level, "%s (copy %.3g s, sent to the next node in %.3g s)", self.note, copy_s, transfer_s)

    # ---- restoring from them ------------------------------------------------------------

    def restore(self, committed: Optional[int]) -> Optional[int]:
        """Collective: loads the newest step every rank holds intact in memory, its own keeper's or the
        replica at its ring successor, into the parts, if no older than `committed` (the newest committed
        step); returns it, or None (restore from storage then)."""
        ck = self.ck
        own, image = self._own()
        copies = self._copies()
        replica = self._replica()
        records = ck.comm.gather_records({"own": own, "copies": sorted(copies), "replica": replica})
        step = None
        if self.rank == 0:
            common = set.intersection(*({r["own"], r["replica"], *r["copies"]} - {None} for r in records))
            if common and (committed is None or max(common) >= committed):
                step = max(common)
            elif common or any(r["own"] is not None or r["replica"] is not None for r in records):
                log.info("in-memory snapshots: no step newer than the committed one (%s) that every rank holds; "
                         "restoring from storage", committed)
        step = ck.comm.broadcast_json(step)
        error = None
        if step is not None and own != step:
            if image is not None:
                image.close()
            image, error = self._copy(*copies[step]) if step in copies else self._fetch(step)
        if ck.link is not None:
            ck.link.release_copies()
        assembly = None
        if image is not None and step is not None:
            assembly, error = self._assemble(image, step)
        if step is None or ck.comm.world_sum([int(error is not None)])[0]:
            if error:
                log.error("rank %d: in-memory snapshot of step %d is unusable: %s", self.rank, step, error)
            if step is not None and self.rank == 0:
                log.warning("in-memory snapshot of step %d cannot be restored on every rank; restoring from storage",
                            step)
            if image is not None:
                image.close()
            return None
        for name, state in assembly.states().items():
            ck.parts[name].load_state_dict(state)
        self.restored_from = {"host memory" if own == step or step in copies else "peer replica": 1}
        self._adopt(image, step, fetched=own != step, resend=own != step or replica != step)
        return step

    def _usable(self, record: Optional[dict]) -> bool:
        """Whether a keeper's record describes a snapshot of this rank, job and format, checksummed."""
        ck = self.ck
        return isinstance(record, dict) and record.get("key") == ck.key and record.get("coords") == list(ck.coords) \
            and record.get("version") == VERSION and record.get("digest") == ck.digest \
            and isinstance(record.get("crc32"), int) and record.get("state") in ("held", "persisted")

    def _own(self) -> tuple[Optional[int], Optional[HostBuffer]]:
        """The step of this rank's snapshot in its node's keeper, with its image, if intact."""
        link = self.ck.link
        record = link.snapshot if link is not None else None
        if not self._usable(record) or link.snapshot_fd is None or record.get("offset", 0) != 0 \
                or record["length"] != link.snapshot_size:
            return None, None
        # A duplicate: the keeper's fd stays with the link for a restore from storage instead.
        image = HostBuffer(link.snapshot_size, fd=os.dup(link.snapshot_fd))
        if checksum(chunks_of(memoryview(image.bytes.numpy()))) != record["crc32"]:
            log.warning("rank %d: the in-memory snapshot of step %d fails its checksum (torn: a copy was cut short)",
                        self.rank, record["step"])
            image.close()
            return None, None
        return record["step"], image

    def _copies(self) -> dict[int, tuple[dict, int]]:
        """The keeper's copies of this rank's newest held snapshots, by step: (record, memfd)."""
        link = self.ck.link
        found = link.copies if link is not None else []
        return {record["step"]: (record, fd) for record, fd in found
                if self._usable(record) and record["length"] == self.ck.plan.size}

    def _copy(self, record: dict, fd: int) -> tuple[Optional[HostBuffer], Optional[str]]:
        """A new buffer holding the keeper's copy of a snapshot, verified against its checksum."""
        image = HostBuffer(record["length"])
        target = memoryview(image.bytes.numpy())
        with mmap.mmap(fd, record["length"], prot=mmap.PROT_READ) as source:
            target[:] = source
        if checksum(chunks_of(target)) != record["crc32"]:
            image.close()
            return None, f"the keeper's copy of step {record['step']} fails its checksum"
        return image, None

    def _replica(self) -> Optional[int]:
        """The step of this rank's replica at its ring successor, if that holds one of this job."""
        if self.peer is None:
            return None
        try:
            record = stat_replica(self.peer, self.key, self.rank)
        except ReplicaError as e:
            log.warning("rank %d: cannot ask for its replica: %s", self.rank, e)
            return None
        return record["step"] if self._usable(record) else None

    def _fetch(self, step: int) -> tuple[Optional[HostBuffer], Optional[str]]:
        """This rank's replica of `step`, fetched from its ring successor and verified."""
        images: list[HostBuffer] = []

        def into(size: int) -> memoryview:
            images.append(HostBuffer(size))
            return memoryview(images[0].bytes.numpy())

        try:
            record = fetch_replica(self.peer, self.key, self.rank, step, into)
            if not self._usable(record):
                raise ReplicaError("the replica is of another rank, job or format")
        except ReplicaError as e:
            for image in images:
                image.close()
            return None, str(e)
        self.fetched_bytes += record["length"]
        return images[0], None

    def _assemble(self, image: HostBuffer, step: int) -> tuple[Optional[Assembly], Optional[str]]:
        """This rank's part states from its own snapshot, or what is wrong with it."""
        ck = self.ck
        # The manifest's records of this stage's parameters, which the image was cut by (same layout).
        manifest = {"tensors": tensor_table([{"pp": ck.ctx.pp.rank, "params": ck.plan.sharded_params()}]),
                    "config": {"model": {"tied_embeddings": ck.cfg.model.tied_embeddings}}}
        try:
            meta, tensors = read_shard(image.fd)
            check_header(meta, tensors)
            assembly = Assembly(ck.plan, manifest, Sources([ck.coords], 0, True), ck.ctx.tp.rank)
            assembly.add(0, step, meta, tensors)
        except CorruptShard as e:
            return None, str(e)
        uncovered = assembly.uncovered()
        return (None, uncovered) if uncovered else (assembly, None)

    def _adopt(self, image: HostBuffer, step: int, fetched: bool, resend: bool) -> None:
        """Keeps the restored image as the save buffer (a `fetched` one becomes the keeper's slot too);
        `resend`: has the keeper hold it again, so that the successor gets it (after a node was replaced)."""
        ck = self.ck
        if image.size != ck.plan.size or ck.buffer is not None:
            image.close()
            return
        ck.buffer = image
        try:
            if fetched and ck.link is not None:
                ck._attach()
            if resend:
                ck._connect().send(self._hold_message(step))  # a new link attaches the buffer first
                self.reading = step
        except KeeperGone as e:
            ck._keeper_lost(str(e))
        except CheckpointError as e:
            log.warning("rank %d: checkpoint keeper unavailable: %s", self.rank, e)
