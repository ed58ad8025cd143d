"""Two-phase checkpointing (MegaScale §4), the rank side.

Phase 1 (`save`, on the training critical path): copy this rank's ZeRO shard (the fp32 master
weights *are* the model weights), its optimizer moments, RNG and data-loader state into a
host buffer laid out as the finished shard file, and tell the node's keeper. Phase 2 runs in
the keeper process: it writes the file with a checksum; once every rank's shard is written,
rank 0's keeper writes the manifest, the commit point. Ranks learn the outcome through a
tiny all-reduce at the next steps (`after_step`), never by waiting.

A fault between persist and commit (the ranks die, the keepers finish writing) does not lose
that checkpoint: `restore` first commits it if every rank's keeper holds the same newer step
persisted. `restore` then takes the newest committed checkpoint whose shards verify: from host memory where
the keeper still holds an intact snapshot matching the manifest, otherwise from storage with
exactly one reader per shard in each DP group, broadcasting to the group. ZeRO pieces are
matched by (parameter name, range), so the DP size may change; tp/pp/vpp may not.
"""
from __future__ import annotations

import json
import logging
import random
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megascale.checkpoint.client import HostBuffer, KeeperGone, KeeperLink
from megascale.checkpoint.storage import (
    CheckpointError, CorruptShard, Storage, checksum, chunks_of, committed_steps, decode_header, encode_header,
    new_manifest, open_storage, read_manifest, read_verified, shard_file, shard_key, step_dir,
)
from megascale.config import JobConfig
from megascale.parallel.topology import ParallelContext
from megascale.parallel.zero import STATE_KEYS  # the ZeRO shard: fp32 master weights and the two moments

log = logging.getLogger("megascale.checkpoint")
RECORD_BYTES = 1024  # one rank's persist outcome, gathered to rank 0 as fixed-size JSON
MODEL_FIELDS = ("layers", "hidden", "heads", "ffn", "vocab", "block", "tied_embeddings")
PAGE = 4096


class Checkpointer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, optimizer: Any, *, every_rank_reads: bool = False):
        """`every_rank_reads` (benchmark baseline only): every rank reads every shard it needs itself."""
        if not cfg.checkpoint.uri:
            raise CheckpointError("checkpoint.uri: not set")
        self.cfg, self.ctx, self.every_rank_reads = cfg, ctx, every_rank_reads
        self.uri = cfg.checkpoint.uri
        self.coords = (ctx.pp.rank, ctx.tp.rank, ctx.dp.rank)
        self.key = shard_key(*self.coords)
        # (name, start, length, offset in this rank's shard) of every owned parameter piece.
        self.pieces = [(optimizer.names[i], start, length, at) for i, start, length, at in optimizer.owned_pieces()]
        self.entries = self._layout(optimizer)
        self.data_bytes = self.entries[-1][4]
        # Room for the header in front of the data; generous, so it rarely needs to grow.
        self.header_room = -(-(64 * len(self.pieces) + (1 << 16)) // PAGE) * PAGE
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
        self.bytes_read = 0  # shard bytes this rank read from storage in restore
        self.restored_from: dict[str, int] = {}
        self.world_pg, self.dp_pg = self._cpu_groups()
        try:  # start the node's keeper now, not on the first save or restore
            self._connect()
        except CheckpointError as e:  # saves retry and report; restore reads storage
            log.warning("rank %d: checkpoint keeper unavailable: %s", ctx.rank, e)

    # ---- setup -------------------------------------------------------------------------

    def _layout(self, optimizer: Any) -> list[tuple[str, str, list[int], int, int]]:
        """The safetensors entries of this rank's shard: fixed for the life of the job."""
        sizes = [(k, "F32", getattr(optimizer, k).numel() * 4) for k in STATE_KEYS]
        sizes.append(("rng.torch", "U8", torch.get_rng_state().numel()))
        if self.ctx.device.type == "cuda":
            sizes.append(("rng.cuda", "U8", torch.cuda.get_rng_state(self.ctx.device).numel()))
        entries, at = [], 0
        for name, dtype, nbytes in sizes:
            entries.append((name, dtype, [nbytes // (4 if dtype == "F32" else 1)], at, at + nbytes))
            at += nbytes
        return entries

    def _cpu_groups(self) -> tuple[Any, Any]:
        """Checkpoint traffic is host memory: on NCCL jobs it gets gloo groups of its own."""
        if self.ctx.layout.world_size == 1 or dist.get_backend() == "gloo":
            return None, self.ctx.dp.pg
        world = dist.new_group(backend="gloo")
        dp = dist.new_group(self.ctx.dp.ranks, backend="gloo", use_local_synchronization=True) \
            if self.ctx.dp.size > 1 else None
        return world, dp

    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.uri, self.cfg.checkpoint.filesystem)
        return self._storage

    def _connect(self) -> KeeperLink:
        if self.link is None:
            c = self.cfg.checkpoint
            self.link = KeeperLink(self.uri, self.ctx.rank, c.filesystem, c.keeper_idle_s)
            if self.buffer is not None:  # a new keeper: hand it the buffer again
                self.link.send({"op": "attach", "rank": self.ctx.rank, "size": self.buffer.size}, (self.buffer.fd,))
                self._expect("attached")
        return self.link

    def prepare(self) -> None:
        """Connects to the keeper and allocates the host buffer now, so the first save stalls no
        longer than the rest. Call after `restore` (which may adopt the keeper's buffer instead)."""
        try:
            self._ensure_buffer(0)
        except CheckpointError as e:  # saves will retry and report
            if isinstance(e, KeeperGone):
                self._keeper_lost(str(e))
            log.warning("rank %d: checkpoint keeper unavailable: %s", self.ctx.rank, e)

    def _expect(self, op: str) -> dict:
        while True:
            reply = self.link.recv(timeout=None)
            if reply[0]["op"] == op:
                return reply[0]
            self._on_message(reply[0])

    # ---- phase 1 -----------------------------------------------------------------------

    def after_step(self, trainer: Any) -> None:
        """Call on every rank after each step: resolves a finished persist, saves every N steps."""
        if self.pending is not None:
            self._resolve(block=False)
        elif self.commit_pending is not None:
            self._drain()
        every = self.cfg.checkpoint.every
        if every and trainer.step_index % every == 0:
            self.save(trainer)

    def save(self, trainer: Any) -> None:
        """Phase 1 (collective only if a previous persist is unfinished): snapshot, hand over, return."""
        started = time.perf_counter()
        busy = self.pending is not None  # the same on every rank: set and cleared by collectives only
        if busy and self.cfg.checkpoint.when_busy == "skip" and trainer.step_index < self.cfg.train.steps:
            self.skipped.append(trainer.step_index)
            if self.ctx.rank == 0:
                log.warning("checkpoint at step %d skipped: step %d is still persisting (checkpoint.when_busy: "
                            "skip)", trainer.step_index, self.pending)
            return
        if busy:
            self._wait_for_persist()
            waited = time.perf_counter() - started
            if self.ctx.rank == 0:
                log.warning("checkpoint at step %d waited %.2f s for the previous one to persist "
                            "(checkpoint.every is short for this storage)", trainer.step_index, waited)
        step = trainer.step_index
        if self.link is not None:
            self._drain()  # notices a keeper that died since: the next connect starts a new one
        self.pending, self.result = step, None
        try:
            header = self._header(trainer)
            buffer = self._ensure_buffer(len(header))
            self._copy_state(trainer.optimizer, buffer)
            offset = self.header_room - len(header)
            buffer.bytes[offset:self.header_room].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            self._connect().send({"op": "persist", "rank": self.ctx.rank, "step": step, "key": self.key,
                                  "coords": list(self.coords), "offset": offset,
                                  "length": len(header) + self.data_bytes, "dir": step_dir(step),
                                  "file": shard_file(self.key)})
        except KeeperGone as e:
            self._keeper_lost(str(e))
        except (CheckpointError, OSError) as e:  # no keeper: this checkpoint fails, training goes on
            self._fail(step, f"{type(e).__name__}: {e}")
        self.stalls.append(time.perf_counter() - started)

    def _header(self, trainer: Any) -> bytes:
        np_state = np.random.get_state()
        meta = {"step": trainer.step_index, "key": self.key, "coords": list(self.coords),
                "layout": self._layout_dict(), "config": self.cfg.to_dict(),
                "optimizer_step": trainer.optimizer.step_count,
                "pieces": self.pieces, "data": trainer.source.state_dict(),
                "rng": {"python": random.getstate(),
                        "numpy": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])]}}
        try:
            text = json.dumps(meta, separators=(",", ":"))
        except TypeError as e:
            raise CheckpointError(f"data loader state is not JSON-serialisable: {e}") from None
        return encode_header(self.entries, {"megascale": text})

    def _layout_dict(self) -> dict:
        layout = self.ctx.layout
        return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp}

    def _ensure_buffer(self, header_len: int) -> HostBuffer:
        if header_len > self.header_room:
            self.header_room = -(-2 * header_len // PAGE) * PAGE
            if self.buffer is not None:
                self.buffer.close()
                self.buffer = None
        if self.buffer is None:
            self.buffer = HostBuffer(self.header_room + self.data_bytes, pin=self.ctx.device.type == "cuda")
            if self.link is not None:
                self.link.send({"op": "attach", "rank": self.ctx.rank, "size": self.buffer.size}, (self.buffer.fd,))
                self._expect("attached")
            else:
                self._connect()  # attaches the new buffer
        return self.buffer

    def _copy_state(self, optimizer: Any, buffer: HostBuffer) -> None:
        cuda = self.ctx.device.type == "cuda"
        for name, dtype, _, begin, end in self.entries:
            target = buffer.bytes[self.header_room + begin:self.header_room + end]
            if name in STATE_KEYS:
                target.view(torch.float32).copy_(getattr(optimizer, name), non_blocking=cuda)
            elif name == "rng.torch":
                target.copy_(torch.get_rng_state())
            elif name == "rng.cuda":
                target.copy_(torch.cuda.get_rng_state(self.ctx.device))
        if cuda:
            torch.cuda.synchronize(self.ctx.device)  # the keeper must see finished bytes

    # ---- phase 2 outcome ---------------------------------------------------------------

    def _fail(self, step: int, error: str) -> None:
        log.error("rank %d: checkpoint step %d not persisted: %s", self.ctx.rank, step, error)
        self.failures.setdefault(step, error)
        if self.pending == step and self.result is None:
            self.result = {"ok": False, "error": error}

    def _on_message(self, msg: dict) -> None:
        op, step = msg["op"], msg.get("step")
        if op == "persisted" and step == self.pending:
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
        waiting, failed = self._world_sum([waiting, failed])
        if waiting:
            return
        step, result = self.pending, self.result
        self.pending = self.result = None
        records = self._gather_records({"key": self.key, **result})
        if self.ctx.rank != 0:
            return
        if failed:
            errors = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if not rec["ok"]]
            self.failures.setdefault(step, errors[0])
            log.error("checkpoint step %d NOT committed: %d rank(s) failed to persist; first: %s",
                      step, len(errors), errors[0])
            return
        shards = {rec["key"]: {"file": shard_file(rec["key"]), "bytes": rec["bytes"], "crc32": rec["crc32"]}
                  for rec in records}
        manifest = new_manifest(step, self._layout_dict(), self.cfg.to_dict(), shards)
        try:
            self._connect().send({"op": "commit", "step": step, "manifest": manifest,
                                  "keep": self.cfg.checkpoint.keep})
            self.commit_pending = step
        except CheckpointError as e:
            self.failures.setdefault(step, str(e))
            log.error("checkpoint step %d NOT committed: %s", step, e)

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
            last = self._broadcast_json(self.last_committed if self.ctx.rank == 0 else None)
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

    def restore(self, trainer: Any) -> Optional[int]:
        """Collective: loads the newest committed checkpoint that verifies; returns its step (None: none exist)."""
        started = time.perf_counter()
        self._commit_interrupted()
        steps = self._broadcast_json(self._committed() if self.ctx.rank == 0 else None)
        if isinstance(steps, str):
            raise CheckpointError(steps)
        tried = 0
        for step in steps:
            manifest = self._broadcast_json(self._read_manifest(step) if self.ctx.rank == 0 else None)
            tried += 1
            if manifest is None:
                continue
            self._check_compatible(manifest)
            assembly, error = self._load(manifest)
            if not self._world_sum([int(error is not None)])[0]:
                self._apply(trainer, manifest, assembly)
                log.info("rank %d: restored step %d (shards from %s) in %.2f s, %d bytes read from storage",
                         self.ctx.rank, step, ", ".join(f"{k}: {n}" for k, n in self.restored_from.items()),
                         time.perf_counter() - started, self.bytes_read)
                return step
            if error:
                log.error("rank %d: checkpoint step %d is unusable: %s", self.ctx.rank, step, error)
            if self.ctx.rank == 0:
                log.warning("checkpoint step %d cannot be restored; falling back to the previous committed one", step)
        if tried:
            raise CheckpointError(f"{self.uri}: none of the {tried} committed checkpoints could be restored "
                                  "(see the errors above)")
        if self.ctx.rank == 0:
            log.info("no committed checkpoint under %s; starting from step 0", self.uri)
        return None

    def _commit_interrupted(self) -> None:
        """Collective: writes the manifest of a checkpoint whose shards every keeper persisted but
        whose ranks stopped before rank 0 committed it (a fault mid-persist), so a restart resumes
        from it, from host memory, instead of replaying the steps since the previous one."""
        records = self._gather_records(self._settled_snapshot())
        if self.ctx.rank != 0:
            return
        layout = self.ctx.layout
        expected = {shard_key(p, t, d) for p in range(layout.pp) for t in range(layout.tp) for d in range(layout.dp)}
        steps = {r.get("step") for r in records}
        if len(steps) != 1 or None in steps or {r["key"] for r in records} != expected \
                or any(r["state"] != "persisted" for r in records):
            return
        step = steps.pop()
        committed = self._committed()
        if isinstance(committed, str) or (committed and committed[0] >= step):
            return
        shards = {r["key"]: {"file": shard_file(r["key"]), "bytes": r["length"], "crc32": r["crc32"]} for r in records}
        try:
            self._connect().send({"op": "commit", "step": step, "keep": self.cfg.checkpoint.keep,
                                  "manifest": new_manifest(step, self._layout_dict(), self.cfg.to_dict(), shards)})
        except CheckpointError as e:
            log.error("checkpoint step %d: persisted but cannot be committed: %s", step, e)
            return
        self.commit_pending = step
        self._drain(until=lambda: self.commit_pending is None)
        if self.last_committed == step:
            log.info("checkpoint step %d was persisted by every keeper but not committed before the ranks "
                     "stopped: committed it now", step)

    def _settled_snapshot(self) -> dict:
        """What this rank's keeper holds, once a persist still running from before a restart ended; {} if nothing."""
        announced = False
        try:
            link = self._connect()
            waited = time.monotonic()
            if (link.snapshot or {}).get("state") == "persisting":
                self.on_wait(f"checkpoint step {link.snapshot['step']} to persist")
                announced = True
            while (link.snapshot or {}).get("state") == "persisting":
                if time.monotonic() - waited > 30:
                    log.warning("rank %d: waiting for the keeper to finish persisting step %d", self.ctx.rank,
                                link.snapshot["step"])
                    waited = time.monotonic()
                time.sleep(0.05)
                link.send({"op": "snapshot", "rank": self.ctx.rank})
                link.snapshot = self._expect("snapshot")["snapshot"]
        except CheckpointError as e:  # no keeper: nothing held, storage it is
            if isinstance(e, KeeperGone):
                self._keeper_lost(str(e))
            log.warning("rank %d: no checkpoint keeper (%s)", self.ctx.rank, e)
            return {}
        finally:
            if announced:
                self.on_wait(None)
        return dict(link.snapshot or {})

    def _committed(self) -> list[int] | str:
        """Committed steps, newest first; or why they cannot be listed (every rank raises it)."""
        try:
            return sorted(committed_steps(self.storage()), reverse=True)
        except (CheckpointError, OSError) as e:
            return f"cannot list the checkpoints under {self.uri}: {e}"

    def _read_manifest(self, step: int) -> Optional[dict]:
        try:
            return read_manifest(self.storage(), step)
        except (CheckpointError, OSError) as e:
            log.error("checkpoint step %d: unreadable manifest: %s", step, e)
            return None

    def _check_compatible(self, manifest: dict) -> None:
        old, new, step = manifest["layout"], self._layout_dict(), manifest["step"]
        if any(old[k] != new[k] for k in ("tp", "pp", "vpp")):
            raise CheckpointError(
                f"checkpoint step {step} was saved with tp={old['tp']} pp={old['pp']} vpp={old['vpp']}, this job has "
                f"tp={new['tp']} pp={new['pp']} vpp={new['vpp']}: only parallelism.dp may change on resume")
        saved, mine = manifest["config"]["model"], self.cfg.to_dict()["model"]
        for name in MODEL_FIELDS:
            if saved.get(name) != mine.get(name):
                raise CheckpointError(f"checkpoint step {step} has model.{name}={saved.get(name)!r}, "
                                      f"this job has model.{name}={mine.get(name)!r}")

    def _load(self, manifest: dict) -> tuple[Optional["Assembly"], Optional[str]]:
        """Collective over the DP group: this rank's pieces from the slice's old shards, or an error."""
        step, old_dp, new_dp = manifest["step"], manifest["layout"]["dp"], self.ctx.dp.size
        pp, tp, dp = self.coords
        keys = [shard_key(pp, tp, j) for j in range(old_dp)]
        missing = [k for k in keys if k not in manifest["shards"]]
        if missing:
            return None, f"manifest lacks shard {missing[0]}"
        assembly = Assembly(self.pieces, own=dp if old_dp == new_dp else None)
        self.restored_from, self.bytes_read = {}, 0
        held, image = self._held(manifest, keys)
        try:
            for j, source, needed in self._plan(old_dp, self._dp_all_gather(held)):
                data, error = None, None
                if source in ("self", self.ctx.dp.rank):
                    data, error = self._fetch(j, held, image, step, manifest["shards"][keys[j]])
                if source != "self":
                    data = self._dp_broadcast(data, source)
                if data is None:
                    return None, error or f"shard {keys[j]} failed on DP rank {source} (see its log)"
                if needed:
                    try:
                        assembly.add(j, keys[j], step, data)
                    except CorruptShard as e:
                        return None, f"{keys[j]}: {e}"
            if assembly.covered != assembly.total:
                return None, f"shards of pp{pp}-tp{tp} cover {assembly.covered} of this rank's {assembly.total} values"
            return assembly, None
        finally:
            image = None
            if getattr(self, "_held_buffer", None) is not None and self._held_buffer is not self.buffer:
                self._held_buffer.close()
            self._held_buffer = None

    def _plan(self, old_dp: int, holders: list[int]) -> list[tuple[int, Any, bool]]:
        """(old shard, who provides it: "self" or a DP member, whether this rank needs it), in the
        same order on every member of the DP group; `holders[i]` is the shard member i has in memory.

        Same DP size: member j needs only old shard j (the partition is the same), so it reads it
        itself, unless another member holds it in memory and sends it. Otherwise a shard may feed
        any member: one member provides it (one holding it in memory, else member j % dp) and
        broadcasts it to the group."""
        me, new_dp = self.ctx.dp.rank, self.ctx.dp.size
        if self.every_rank_reads:
            return [(j, "self", True) for j in range(old_dp)]
        plan = []
        for j in range(old_dp):
            source = holders.index(j) if j in holders else (j if old_dp == new_dp else j % new_dp)
            if old_dp == new_dp and source == j:
                if j == me:
                    plan.append((j, "self", True))
                continue
            plan.append((j, source, old_dp != new_dp or j == me))
        return plan

    def _held(self, manifest: dict, keys: list[str]) -> tuple[int, Optional[torch.Tensor]]:
        """(old DP index, image) of the shard of this slice the keeper holds intact for `manifest`, else (-1, None)."""
        self._held_buffer = None
        try:
            link = self._connect()
        except CheckpointError as e:
            log.warning("rank %d: no checkpoint keeper (%s); reading storage", self.ctx.rank, e)
            return -1, None
        snap = link.snapshot
        if not snap or snap.get("state") != "persisted" or snap["key"] not in keys:
            return -1, None
        entry = manifest["shards"][snap["key"]]
        if snap["step"] != manifest["step"] or (snap["crc32"], snap["length"]) != (entry["crc32"], entry["bytes"]):
            log.info("rank %d: host snapshot is of step %d, the checkpoint is step %d; reading storage",
                     self.ctx.rank, snap["step"], manifest["step"])
            return -1, None
        fd = link.take_snapshot_fd()
        buffer = HostBuffer(link.snapshot_size, fd=fd)
        image = buffer.bytes[snap["offset"]:snap["offset"] + snap["length"]]
        if checksum(chunks_of(memoryview(image.numpy()))) != entry["crc32"]:
            log.warning("rank %d: host snapshot of step %d fails its checksum; reading storage",
                        self.ctx.rank, manifest["step"])
            buffer.close()
            return -1, None
        self._held_buffer = buffer
        if self.buffer is None and buffer.size == self.header_room + self.data_bytes and snap["key"] == self.key:
            self.buffer = buffer  # the keeper's slot already maps it: saves reuse it, no new allocation
        link.snapshot = None
        return snap["coords"][2], image

    def _fetch(self, j: int, held: int, image: Optional[torch.Tensor], step: int,
               entry: dict) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """Old shard j: from the host snapshot if this rank holds it, else read from storage."""
        if held == j:
            self.restored_from["host memory"] = self.restored_from.get("host memory", 0) + 1
            return image, None
        return self._read(step, entry)

    def _read(self, step: int, entry: dict) -> tuple[Optional[torch.Tensor], Optional[str]]:
        data = torch.empty(entry["bytes"], dtype=torch.uint8)
        path = self.storage().path(step_dir(step), entry["file"])
        try:
            read_verified(self.storage(), path, memoryview(data.numpy()), entry["crc32"])
        except (CorruptShard, OSError) as e:
            log.error("rank %d: %s", self.ctx.rank, e)
            return None, str(e)
        self.bytes_read += entry["bytes"]
        self.restored_from["storage"] = self.restored_from.get("storage", 0) + 1
        return data, None

    def _apply(self, trainer: Any, manifest: dict, assembly: "Assembly") -> None:
        trainer.optimizer.load_shard_state(assembly.optimizer_step, assembly.lookup)
        trainer.step_index = manifest["step"]
        trainer.source.load_state_dict(assembly.data)
        if assembly.rng is not None:  # same DP rank as when saved: continue its random streams exactly
            tensors, states = assembly.rng
            torch.set_rng_state(tensors["rng.torch"])
            if "rng.cuda" in tensors and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(tensors["rng.cuda"], self.ctx.device)
            version, state, gauss = states["python"]
            random.setstate((version, tuple(state), gauss))
            name, keys, *rest = states["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
        self.last_committed = manifest["step"]

    # ---- collectives (host tensors; no-ops on one rank) --------------------------------

    def _world_sum(self, values: list[int]) -> list[int]:
        if self.ctx.layout.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, group=self.world_pg)
        return t.tolist()

    def _broadcast_json(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.ctx.layout.world_size == 1:
            return value
        data = json.dumps(value).encode() if self.ctx.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.world_pg)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.ctx.rank == 0 else \
            torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.world_pg)
        return json.loads(bytes(buf.numpy()))

    def _gather_records(self, record: dict) -> list[dict]:
        if self.ctx.layout.world_size == 1:
            return [record]
        if "error" in record:
            record["error"] = record["error"][:RECORD_BYTES // 2]
        raw = json.dumps(record).encode().ljust(RECORD_BYTES)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(t) for _ in range(self.ctx.layout.world_size)] if self.ctx.rank == 0 else None
        dist.gather(t, out, dst=0, group=self.world_pg)
        return [json.loads(bytes(o.numpy())) for o in out] if out else []

    def _dp_all_gather(self, value: int) -> list[int]:
        if self.ctx.dp.size == 1:
            return [value]
        t = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.ctx.dp.size)]
        dist.all_gather(out, t, group=self.dp_pg)
        return [int(o) for o in out]

    def _dp_broadcast(self, data: Optional[torch.Tensor], source: int) -> Optional[torch.Tensor]:
        """The source member's bytes on every member; None everywhere if the source had none."""
        if self.ctx.dp.size == 1:
            return data
        src = self.ctx.dp.ranks[source]
        mine = source == self.ctx.dp.rank
        n = torch.tensor([data.numel() if mine and data is not None else -1], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.dp_pg)
        if int(n) < 0:
            return None
        if not mine:
            data = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(data, src=src, group=self.dp_pg)
        return data


class Assembly:
    """This rank's ZeRO pieces, filled from old shards cut for any DP size."""

    def __init__(self, pieces: list, own: Optional[int]):
        self.own = own  # old DP index whose RNG this rank continues (same DP size only)
        self.slots: dict[str, list[tuple[int, int, int]]] = {}
        at = 0
        for name, start, length, _ in pieces:
            self.slots.setdefault(name, []).append((start, length, at))
            at += length
        self.total, self.covered = at, 0
        self.state = {k: torch.empty(at, dtype=torch.float32) for k in STATE_KEYS}
        self.data: Optional[dict] = None
        self.rng: Optional[tuple[dict, dict]] = None
        self.optimizer_step = 0

    def add(self, j: int, key: str, step: int, image: torch.Tensor) -> None:
        header, start = decode_header(memoryview(image.numpy()))
        try:
            meta = json.loads(header["__metadata__"]["megascale"])
        except (KeyError, TypeError, ValueError):
            raise CorruptShard("no megascale metadata in the shard header") from None
        if meta["step"] != step or meta["key"] != key:
            raise CorruptShard(f"shard header says step {meta['step']} {meta['key']}, expected step {step} {key}")
        tensors = {}
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                raw = image[start + begin:start + end]
                tensors[name] = raw.view(torch.float32) if entry["dtype"] == "F32" else raw
        for name, ostart, olength, oat in meta["pieces"]:
            for start_, length, at in self.slots.get(name, ()):
                lo, hi = max(start_, ostart), min(start_ + length, ostart + olength)
                if lo < hi:
                    for k in STATE_KEYS:
                        self.state[k][at + lo - start_:at + hi - start_] = \
                            tensors[k][oat + lo - ostart:oat + hi - ostart]
                    self.covered += hi - lo
        if self.data is None or j == self.own:
            self.data, self.optimizer_step = meta["data"], meta["optimizer_step"]
        if j == self.own:
            self.rng = ({k: v.clone() for k, v in tensors.items() if k.startswith("rng.")}, meta["rng"])

    def lookup(self, name: str, start: int, length: int) -> dict[str, torch.Tensor]:
        for start_, length_, at in self.slots[name]:
            if (start_, length_) == (start, length):
                return {k: v[at:at + length] for k, v in self.state.items()}
        raise CheckpointError(f"no restored piece {name}[{start}:{start + length}]")


def _plain(value: Any) -> Any:
    """numpy scalars -> Python numbers, for JSON."""
    return value.item() if hasattr(value, "item") else value
