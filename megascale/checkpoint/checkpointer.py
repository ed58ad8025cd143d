"""Two-phase checkpointing (MegaScale §4), the rank side.

It saves and restores *parts*: objects with `state_dict` / `load_state_dict` (stateful.py), never a
trainer's attributes. Phase 1 (`save`, on the training critical path): copy the parts' state into a
host buffer laid out as the finished shard file (save_plan.py) and tell the node's keeper. Phase 2
runs in the keeper process: it writes the file with a checksum; once every rank's shard is written,
rank 0's keeper writes the manifest, the commit point. Ranks learn the outcome through a tiny
all-reduce at the next steps (`after_step`), never by waiting.

A fault between persist and commit (the ranks die, the keepers finish writing) does not lose that
checkpoint: `restore` first commits it if every rank's keeper holds the same newer step persisted.
`restore` then takes the newest committed checkpoint whose shards verify: from host memory where the
keeper still holds an intact snapshot matching the manifest, otherwise from storage with exactly one
reader per shard in each DP group, broadcasting to the group (restore_plan.py). Between persisted
checkpoints, in-memory snapshots replicated to the next node (memory_snapshots.py) are restored first
when they are newer.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Optional

from megascale.checkpoint.client import KeeperGone, KeeperLink
from megascale.checkpoint.host_buffer import HostBuffer
from megascale.checkpoint.host_comm import HostGroups
from megascale.checkpoint.memory_snapshots import MemorySnapshots, snapshot_digest
from megascale.checkpoint.reshard import describe, slice_sources
from megascale.checkpoint.restore_plan import Assembly, SliceReader, interrupted_step
from megascale.checkpoint.save_plan import SavePlan, tensor_table
from megascale.checkpoint.stateful import Stateful
from megascale.checkpoint.storage import (
    VERSION, CheckpointError, OtherFormat, Storage, check_compatible, committed_or_why, manifest_or_why, new_manifest,
    open_storage, shard_file, shard_key, step_dir,
)
from megascale.config import JobConfig
from megascale.parallel.topology import ParallelContext

log = logging.getLogger("megascale.checkpoint")


class Checkpointer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, parts: Mapping[str, Stateful], *,
                 every_rank_reads: bool = False):
        """Collective. `parts`: what a checkpoint holds, by name (the same names on every rank and run).
        `every_rank_reads` (benchmark baseline only): every rank reads every shard it needs itself."""
        if not cfg.checkpoint.uri:
            raise CheckpointError("checkpoint.uri: not set")
        self.cfg, self.ctx, self.parts, self.every_rank_reads = cfg, ctx, dict(parts), every_rank_reads
        self.uri = cfg.checkpoint.uri
        self.coords = (ctx.pp.rank, ctx.tp.rank, ctx.dp.rank)
        self.key = shard_key(*self.coords)
        self.layout = {"tp": ctx.layout.tp, "pp": ctx.layout.pp, "dp": ctx.layout.dp, "vpp": ctx.layout.vpp}
        self.plan = SavePlan(self.parts, self._meta(0))
        self.digest = snapshot_digest(cfg.to_dict(), self.layout, self.plan)
        self.memory: Optional[MemorySnapshots] = None
        self._storage: Optional[Storage] = None
        self.link: Optional[KeeperLink] = None
        self.buffer: Optional[HostBuffer] = None
        self.pending: Optional[int] = None  # step handed to the keeper, not yet resolved everywhere
        # Told what training is blocked on while it waits for the keeper (a string), then None.
        self.on_wait: Callable[[Optional[str]], None] = lambda what: None
        self.result: Optional[dict] = None  # this rank's persist outcome for `pending`
        self.commit_pending: Optional[int] = None  # rank 0: manifest write in flight
        self.last_committed: Optional[int] = None
        self.stalls: list[float] = []  # seconds each save blocked the training loop
        self.skipped: list[int] = []  # steps whose save was skipped (checkpoint.when_busy: skip)
        self.persist_seconds: list[float] = []
        self.failures: dict[int, str] = {}  # step -> why it was not committed
        self.reader: Optional[SliceReader] = None  # the last restore's reads
        self.comm = HostGroups(ctx)
        self.tensors = self._tensor_table()
        try:  # start the node's keeper now, not on the first save or restore
            self._connect()
        except CheckpointError as e:  # saves retry and report; restore reads storage
            log.warning("rank %d: checkpoint keeper unavailable: %s", ctx.rank, e)
        if cfg.checkpoint.memory_every != 0:
            self.memory = MemorySnapshots(self)

    @property
    def bytes_read(self) -> int:
        """Shard bytes this rank read from storage in the last restore."""
        return self.reader.bytes_read if self.reader else 0

    @property
    def restored_from(self) -> dict[str, int]:
        """How many of the last restore's shards came from where ("host memory", "storage", "peer replica")."""
        if self.reader is not None:
            return dict(self.reader.restored_from)
        return dict(self.memory.restored_from) if self.memory is not None else {}

    # ---- setup -------------------------------------------------------------------------

    def _meta(self, step: int) -> dict:
        """What every shard header says besides the parts' state."""
        return {"step": step, "key": self.key, "coords": list(self.coords), "layout": self.layout}

    def _tensor_table(self) -> dict:
        """Rank 0 (which writes the manifests): every ShardedFlat parameter of the model; one rank per
        pipeline stage contributes its own."""
        contributes = self.ctx.tp.rank == 0 and self.ctx.dp.rank == 0
        return tensor_table(self.comm.gather_json(
            {"pp": self.ctx.pp.rank, "params": self.plan.sharded_params()} if contributes else None))

    def storage(self) -> Storage:
        c = self.cfg.checkpoint
        self._storage = self._storage or open_storage(self.uri, c.filesystem, c.filesystem_options)
        return self._storage

    def _connect(self) -> KeeperLink:
        if self.link is None:
            c = self.cfg.checkpoint
            self.link = KeeperLink(self.uri, self.ctx.rank, c.filesystem, c.filesystem_options, c.keeper_idle_s)
            if self.buffer is not None:  # a new keeper: hand it the buffer again
                self._attach()
            if self.memory is not None and self.memory.address is not None:  # and serve replicas again
                self.memory.listen(self.link)
        return self.link

    def _attach(self) -> None:
        self.link.send({"op": "attach", "rank": self.ctx.rank, "size": self.buffer.size}, (self.buffer.fd,))
        self._expect("attached")

    def prepare(self) -> None:
        """Connects to the keeper and allocates the host buffer now, so the first save stalls no
        longer than the rest. Call after `restore` (which may adopt the keeper's buffer instead)."""
        try:
            self._ensure_buffer()
        except CheckpointError as e:  # saves will retry and report
            if isinstance(e, KeeperGone):
                self._keeper_lost(str(e))
            log.warning("rank %d: checkpoint keeper unavailable: %s", self.ctx.rank, e)

    def _ensure_buffer(self) -> HostBuffer:
        if self.buffer is not None and self.buffer.size != self.plan.size:  # the header outgrew its room
            self.buffer.close()
            self.buffer = None
        if self.buffer is None:
            self.buffer = HostBuffer(self.plan.size, pin=self.ctx.device.type == "cuda")
            if self.link is not None:
                self._attach()
            else:
                self._connect()  # attaches the new buffer
        return self.buffer

    def _expect(self, op: str) -> dict:
        while True:
            reply = self.link.recv(timeout=None)
            if reply[0]["op"] == op:
                return reply[0]
            self._on_message(reply[0])

    # ---- phase 1 -----------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        """Call on every rank after each step (`step`: steps done): resolves a finished persist, and
        saves every checkpoint.every steps, and keeps in-memory snapshots in between."""
        arrived = time.perf_counter()
        if self.pending is not None:
            self._resolve(block=False)
        elif self.commit_pending is not None:
            self._drain()
        every = self.cfg.checkpoint.every
        if every and step % every == 0:
            self.save(step)
        if self.memory is not None:
            self.memory.after_step(step, arrived)

    def save(self, step: int) -> None:
        """Phase 1 (collective only if a previous persist is unfinished): snapshot, hand over, return."""
        started = time.perf_counter()
        busy = self.pending is not None  # the same on every rank: set and cleared by collectives only
        if busy and self.cfg.checkpoint.when_busy == "skip" and step < self.cfg.train.steps:
            self.skipped.append(step)
            if self.ctx.rank == 0:
                log.warning("checkpoint at step %d skipped: step %d is still persisting (checkpoint.when_busy: "
                            "skip)", step, self.pending)
            return
        if busy:
            self._wait_for_persist()
            if self.ctx.rank == 0:
                log.warning("checkpoint at step %d waited %.2f s for the previous one to persist "
                            "(checkpoint.every is short for this storage)", step, time.perf_counter() - started)
        if self.link is not None:
            self._drain()  # notices a keeper that died since: the next connect starts a new one
        if self.memory is not None:
            self.memory.settle()  # the keeper still reads the last in-memory snapshot from the buffer
        self.pending, self.result = step, None
        try:
            header, tensors = self.plan.capture(self._meta(step))
            buffer = self._ensure_buffer()
            self.plan.write(buffer.bytes, header, tensors, self.ctx.device)
            self._connect().send({"op": "persist", "rank": self.ctx.rank, "step": step, "key": self.key,
                                  "coords": list(self.coords), "version": VERSION, "offset": 0,
                                  "length": self.plan.size, "dir": step_dir(step), "file": shard_file(self.key),
                                  "digest": self.digest})
        except KeeperGone as e:
            self._keeper_lost(str(e))
        except (CheckpointError, OSError) as e:  # no keeper: this checkpoint fails, training goes on
            self._fail(step, f"{type(e).__name__}: {e}")
        self.stalls.append(time.perf_counter() - started)

    # ---- phase 2 outcome ---------------------------------------------------------------

    def _fail(self, step: int, error: str) -> None:
        log.error("rank %d: checkpoint step %d not persisted: %s", self.ctx.rank, step, error)
        self.failures.setdefault(step, error)
        if self.pending == step and self.result is None:
            self.result = {"ok": False, "error": error}

    def _on_message(self, msg: dict) -> None:
        op, step = msg["op"], msg.get("step")
        if self.memory is not None and op in ("held", "error") and step is not None and step == self.memory.reading:
            self.memory.on_held(msg)
        elif op == "persisted" and step == self.pending:
            self.result = {"ok": True, "crc32": msg["crc32"], "bytes": msg["bytes"]}
            self.persist_seconds.append(msg["seconds"])
        elif op in ("persist_failed", "error") and step == self.pending:
            self._fail(step, msg["error"])
        elif op == "committed":
            self.last_committed, self.commit_pending = step, None
            log.info("checkpoint step %d committed to %s%s", step, self.uri,
                     f" (removed steps {msg['removed']})" if msg["removed"] else "")
        elif op in ("commit_failed", "error") and step == self.commit_pending:
            self.commit_pending = None
            self.failures.setdefault(step, msg["error"])
            log.error("checkpoint step %d NOT committed: writing its manifest failed: %s", step, msg["error"])

    def _drain(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Handles the keeper's messages: those waiting now, or (with `until`) until it holds."""
        waited_since = time.monotonic()
        while self.link is not None:
            done = until is None or until()
            if done and until is not None:
                return
            try:
                reply = self.link.recv(timeout=0 if done else 60)
            except KeeperGone as e:
                self._keeper_lost(str(e))
                return
            if reply is None:
                if done:
                    return
                log.warning("rank %d: still waiting for the checkpoint keeper after %.0f s", self.ctx.rank,
                            time.monotonic() - waited_since)
                continue
            self._on_message(reply[0])

    def _keeper_lost(self, reason: str) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.memory is not None:
            self.memory.reading = None
        if self.pending is not None and self.result is None:
            self._fail(self.pending, reason)
        if self.commit_pending is not None:
            log.error("checkpoint step %d NOT committed: %s", self.commit_pending, reason)
            self.failures.setdefault(self.commit_pending, reason)
            self.commit_pending = None

    def _resolve(self, block: bool) -> None:
        """Collective: once every rank's persist of `pending` has finished, rank 0 commits it."""
        if self.result is None:
            self._drain(until=(lambda: self.result is not None) if block else None)
        if self.result is None and self.link is None:
            self._fail(self.pending, "checkpoint keeper connection lost")
        waiting = int(self.result is None)
        failed = int(self.result is not None and not self.result["ok"])
        waiting, failed = self.comm.world_sum([waiting, failed])
        if waiting:
            return
        step, result = self.pending, self.result
        self.pending = self.result = None
        records = self.comm.gather_records({"key": self.key, **result})
        if self.ctx.rank != 0:
            return
        if failed:
            errors = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if not rec["ok"]]
            self.failures.setdefault(step, errors[0])
            log.error("checkpoint step %d NOT committed: %d rank(s) failed to persist; first: %s",
                      step, len(errors), errors[0])
            return
        self._commit(step, {rec["key"]: (rec["bytes"], rec["crc32"]) for rec in records})

    def _commit(self, step: int, shards: dict[str, tuple[int, int]]) -> bool:
        """Rank 0: asks its keeper to write the manifest of `step` ({shard key: (bytes, crc32)})."""
        manifest = new_manifest(step, self.layout, self.cfg.to_dict(),
                                {key: {"file": shard_file(key), "bytes": n, "crc32": crc}
                                 for key, (n, crc) in shards.items()},
                                parts=list(self.parts), tensors=self.tensors)
        try:
            self._connect().send({"op": "commit", "step": step, "manifest": manifest,
                                  "keep": self.cfg.checkpoint.keep})
        except CheckpointError as e:
            self.failures.setdefault(step, str(e))
            log.error("checkpoint step %d NOT committed: %s", step, e)
            return False
        self.commit_pending = step
        return True

    def _wait_for_persist(self) -> None:
        """Blocks training until every rank's persist of `pending` ended (saying so through `on_wait`)."""
        self.on_wait(f"checkpoint step {self.pending} to persist")
        try:
            self._resolve(block=True)
        finally:
            self.on_wait(None)

    def flush(self) -> Optional[int]:
        """Collective: waits for the pending checkpoint to commit (or fail); returns the last committed step."""
        step = self.pending if self.pending is not None else self.commit_pending
        if step is not None:
            self.on_wait(f"checkpoint step {step} to persist")
        try:
            if self.pending is not None:
                self._resolve(block=True)
            if self.commit_pending is not None:
                self._drain(until=lambda: self.commit_pending is None)
            last = self.comm.broadcast_json(self.last_committed if self.ctx.rank == 0 else None)
        finally:
            if step is not None:
                self.on_wait(None)
        self.last_committed = last
        return last

    def close(self) -> None:
        """Not collective: disconnects. The keeper keeps this rank's last snapshot for a restart."""
        if self.link is not None:
            self._drain()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    # ---- restore -----------------------------------------------------------------------

    def restore(self) -> Optional[int]:
        """Collective: loads the newest committed checkpoint that verifies into the parts; returns its
        step (None: none exist)."""
        started = time.perf_counter()
        self._commit_interrupted()
        steps = self.comm.broadcast_json(committed_or_why(self.storage(), self.uri) if self.ctx.rank == 0 else None)
        if isinstance(steps, str):
            raise CheckpointError(steps)
        if self.memory is not None:
            step = self.memory.restore(steps[0] if steps else None)
            if step is not None:
                self.reader, self.last_committed = None, steps[0] if steps else None
                log.info("rank %d: restored step %d (shards from %s: 1) in %.2f s, 0 bytes read from storage, %d "
                         "from the peer", self.ctx.rank, step, *self.restored_from, time.perf_counter() - started,
                         self.memory.fetched_bytes)
                return step
        for step in steps:
            manifest = self.comm.broadcast_json(manifest_or_why(self.storage(), step) if self.ctx.rank == 0 else None)
            if isinstance(manifest, str):  # another format: older checkpoints are no better
                raise OtherFormat(manifest)
            if manifest is None:
                continue
            check_compatible(manifest, self.cfg.to_dict()["model"], self.parts)
            if self.ctx.rank == 0 and manifest["layout"] != self.layout:
                log.info("checkpoint step %d was saved with %s: resharding it onto %s", step,
                         describe(manifest["layout"]), describe(self.layout))
            assembly, error = self._load(manifest)
            if not self.comm.world_sum([int(error is not None)])[0]:
                for name, state in assembly.states().items():
                    self.parts[name].load_state_dict(state)
                self.last_committed = step
                log.info("rank %d: restored step %d (shards from %s) in %.2f s, %d bytes read from storage",
                         self.ctx.rank, step, ", ".join(f"{k}: {n}" for k, n in self.restored_from.items()),
                         time.perf_counter() - started, self.bytes_read)
                return step
            if error:
                log.error("rank %d: checkpoint step %d is unusable: %s", self.ctx.rank, step, error)
            if self.ctx.rank == 0:
                log.warning("checkpoint step %d cannot be restored; falling back to the previous committed one", step)
        if steps:
            raise CheckpointError(f"{self.uri}: none of the {len(steps)} committed checkpoints could be restored "
                                  "(see the errors above)")
        if self.ctx.rank == 0:
            log.info("no committed checkpoint under %s; starting from step 0", self.uri)
        return None

    def _commit_interrupted(self) -> None:
        """Collective: writes the manifest of a checkpoint whose shards every keeper persisted but
        whose ranks stopped before rank 0 committed it (a fault mid-persist), so a restart resumes
        from it, from host memory, instead of replaying the steps since the previous one."""
        records = self.comm.gather_records(self._settled_snapshot())
        step = interrupted_step(records, self.layout) if self.ctx.rank == 0 else None
        if step is None:
            return
        committed = committed_or_why(self.storage(), self.uri)
        if isinstance(committed, str) or (committed and committed[0] >= step):
            return
        if not self._commit(step, {r["key"]: (r["length"], r["crc32"]) for r in records}):
            return
        self._drain(until=lambda: self.commit_pending is None)
        if self.last_committed == step:
            log.info("checkpoint step %d was persisted by every keeper but not committed before the ranks "
                     "stopped: committed it now", step)

    def _settled_snapshot(self) -> dict:
        """What this rank's keeper holds, once a persist still running from before a restart ended; {} if nothing."""
        try:
            return self._connect().settled_snapshot(self.on_wait)
        except CheckpointError as e:  # no keeper: nothing held, storage it is
            if isinstance(e, KeeperGone):
                self._keeper_lost(str(e))
            log.warning("rank %d: no checkpoint keeper (%s)", self.ctx.rank, e)
            return {}

    def _load(self, manifest: dict) -> tuple[Optional[Assembly], Optional[str]]:
        """Collective over the DP group: this rank's part states from the old shards it needs, or an error."""
        try:
            sources = slice_sources(manifest, self.layout, self.coords, self.plan.sharded)
        except CheckpointError as e:  # the same on every member of the DP group: before any collective
            return None, str(e)
        self.reader = SliceReader(self.storage(), self.comm, manifest, sources, self.every_rank_reads)
        held, image = -1, None
        try:
            held, image = self.reader.held(self._connect())
        except CheckpointError as e:
            log.warning("rank %d: no checkpoint keeper (%s); reading storage", self.ctx.rank, e)
        if image is not None and self.buffer is None and image.size == self.plan.size \
                and self.reader.keys[held] == self.key:
            self.buffer = image  # this rank's own snapshot, which the keeper's slot maps: saves reuse it
        elif self.buffer is None:
            self.prepare()  # the save buffer now: this rank's shard is read into it, not into one more buffer
        try:
            return self.reader.load(self.plan, held, image, into=self.buffer if self.buffer is not image else None)
        finally:
            if image is not None and image is not self.buffer:
                image.close()
