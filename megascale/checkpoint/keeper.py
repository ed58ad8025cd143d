"""The per-node snapshot keeper: phase 2 of checkpointing, in its own process.

It holds each local rank's latest snapshot (a memfd the rank filled in phase 1), writes it to
storage with a checksum when asked, and writes the manifest for rank 0. In-memory snapshots
(`hold`) are not persisted: it checksums them, sends them to the next node's keeper (and holds that
node's predecessor's in turn, replica.py) and keeps a copy of each rank's last two (KEPT_COPIES). It outlives the
training processes, so after the ranks restart on the same node they get their snapshots back
from it instead of from storage. It exits after `--idle-s` seconds without a connected rank,
on a `shutdown` message, or when the executor named by MEGASCALE_NODE_PID exits (the node is gone).
A rank starts it on demand; an executor daemon can start and own
it instead by running `python -m megascale.checkpoint.keeper --uri URI` itself.

No torch here, so it starts in a fraction of a second.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import psutil

from megascale.checkpoint import ipc
from megascale.checkpoint.replica import ReplicaError, ReplicaServer, send_replica
from megascale.checkpoint.storage import (Storage, apply_retention, checksum, chunks_of, normalize_uri, open_storage,
                                          write_file, write_manifest)

log = logging.getLogger("megascale.checkpoint")
# A restarted rank's hello waits this long for a replica still going to the next node before cutting it short
HELLO_WAIT_S = 2.0
# Copies of each rank's newest held snapshots the keeper keeps besides the buffer. Nodes finish sending a
# step's replicas at different moments: a node lost while its replica of step S is still in flight leaves
# the next node holding S-1 of its ranks, while the survivors' buffers already hold S. With their last two
# steps kept, every rank still has a step in common (S-1), one more replayed instead of a restore from storage.
KEPT_COPIES = 2


@dataclass
class Slot:
    """One rank's host buffer; `snapshot` describes the file image in it, if any."""

    fd: int
    size: int
    view: mmap.mmap
    snapshot: Optional[dict] = None
    # Held while the keeper reads the buffer: a restarted rank's hello waits, so it cannot overwrite
    # a snapshot still being persisted or sent.
    reading: threading.Lock = field(default_factory=threading.Lock)
    sending: Optional[socket.socket] = None  # the connection to the next node's keeper while a replica goes out
    copies: list[Copy] = field(default_factory=list)  # of the newest held snapshots, oldest first

    def keep_copy(self, image: memoryview, record: dict) -> None:
        """Copies a snapshot just held into the oldest copy's memory (a new one while fewer are kept)."""
        if len(self.copies) < KEPT_COPIES or self.copies[0].view.size() != len(image):
            copy = Copy.of_size(len(image))
        else:
            copy = self.copies.pop(0)
            copy.record = None  # torn while it is overwritten: a hello now passes it over
        copy.view[:] = image
        copy.record = record
        self.copies.append(copy)
        while len(self.copies) > KEPT_COPIES:
            self.copies.pop(0).close()

    def close(self) -> None:
        ipc.close_mapping(self.view, self.fd)
        for copy in self.copies:
            copy.close()


@dataclass
class Copy:
    """A copy of one held snapshot, in a memfd a restarting rank is handed with its hello."""

    fd: int
    view: mmap.mmap
    record: Optional[dict] = None

    @classmethod
    def of_size(cls, size: int) -> Copy:
        fd = os.memfd_create("megascale-snapshot-copy", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, mmap.mmap(fd, size))
        except OSError:
            os.close(fd)
            raise

    def close(self) -> None:
        ipc.close_mapping(self.view, self.fd)


class Keeper:
    def __init__(self, storage: Storage, name: str, idle_s: float, on_exit: Callable[[], None] = lambda: None):
        self.storage, self.name, self.idle_s, self.on_exit = storage, name, idle_s, on_exit
        self.slots: dict[int, Slot] = {}
        self.live: collections.Counter = collections.Counter()  # rank -> open connections
        self.lock = threading.Lock()
        self.connections = 0
        self.last_active = time.monotonic()
        self.node_pid = os.environ.get("MEGASCALE_NODE_PID")
        self.node = _process(self.node_pid)
        self.replica_key: Optional[bytes] = None  # the newest one the ranks handed over
        self.replicas: Optional[ReplicaServer] = None  # started by the first `listen`

    def node_alive(self) -> bool:
        """Whether the executor this keeper serves still runs: a node's memory goes with the node
        (on a cluster the pod takes the keeper with it; locally this does)."""
        if not self.node_pid:
            return True
        if self.node is None:
            return False
        try:
            return self.node.is_running() and self.node.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def serve(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server.bind(self.name)
        except OSError:
            log.info("another keeper already serves %s; exiting", self.storage.uri)
            return
        server.listen(256)
        server.settimeout(1.0)
        log.info("keeper pid %d serving %s", os.getpid(), self.storage.uri)
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                with self.lock:
                    idle = self.connections == 0 and time.monotonic() - self.last_active > self.idle_s
                if idle:
                    log.info("no rank connected for %.0f s; exiting (host snapshots dropped)", self.idle_s)
                    self.on_exit()
                    return
                if not self.node_alive():
                    log.info("the node's executor exited; exiting with it (host snapshots dropped)")
                    self.on_exit()
                    return
                continue
            if ipc.peer_uid(conn) != os.getuid():  # abstract sockets have no file permissions
                conn.close()
                continue
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve_rank, args=(conn,), daemon=True).start()

    def _serve_rank(self, conn: socket.socket) -> None:
        rank = None
        try:
            while True:
                msg, fds = ipc.recv(conn)
                if msg["op"] == "hello" and rank is None:
                    rank = msg["rank"]
                    with self.lock:
                        self.live[rank] += 1
                try:
                    reply, out_fds = self._handle(msg, fds)
                except Exception as e:  # a bad request must not take the keeper down
                    log.exception("request %s failed", msg.get("op"))
                    reply, out_fds = {"op": "error", "step": msg.get("step"), "error": f"{type(e).__name__}: {e}"}, []
                ipc.send(conn, reply, out_fds)
                if msg["op"] == "shutdown":
                    self.on_exit()
                    os._exit(0)
        except (EOFError, OSError):
            pass  # the rank exited or restarted; its slot (and snapshot) stays
        finally:
            conn.close()
            with self.lock:
                self.connections -= 1
                self.last_active = time.monotonic()
                if rank is not None:
                    self.live[rank] -= 1

    def _handle(self, msg: dict, fds: list[int]) -> tuple[dict, list[int]]:
        op, rank = msg["op"], msg.get("rank", -1)
        if op == "hello":
            slot = self.slots.get(rank)
            if slot is None:
                return {"op": "hello", "pid": os.getpid(), "snapshot": None, "size": 0}, []
            if not slot.reading.acquire(timeout=HELLO_WAIT_S):
                sending = slot.sending
                if sending is not None:  # the peer has stopped reading (frozen, gone): the restart comes first
                    log.warning("rank %d restarts: abandoning its replica's send to the next node", rank)
                    with contextlib.suppress(OSError):
                        sending.shutdown(socket.SHUT_RDWR)
                slot.reading.acquire()  # a persist to storage in progress is waited for, as before
            copies = [c for c in slot.copies if c.record is not None]
            slot.reading.release()
            return {"op": "hello", "pid": os.getpid(), "snapshot": slot.snapshot, "size": slot.size,
                    "copies": [c.record for c in copies]}, [slot.fd, *(c.fd for c in copies)]
        if op == "attach":
            new = Slot(fds[0], msg["size"], mmap.mmap(fds[0], msg["size"], prot=mmap.PROT_READ))
            with self.lock:
                old, self.slots[rank] = self.slots.get(rank), new
            if old is not None:
                new.copies, old.copies = old.copies, []  # a new buffer; the steps held before it stay restorable
                old.close()
            return {"op": "attached"}, []
        if op == "persist":
            if rank not in self.slots:
                return {"op": "persist_failed", "step": msg["step"], "error": f"rank {rank} attached no buffer"}, []
            return self._persist(self.slots[rank], msg), []
        if op == "commit":
            return self._commit(msg), []
        if op == "hold":
            if rank not in self.slots:
                return {"op": "held", "step": msg["step"], "error": f"rank {rank} attached no buffer"}, []
            return self._hold(rank, self.slots[rank], msg), []
        if op == "listen":
            return self._listen(msg), []
        if op == "snapshot":  # a restarted rank polls a persist its predecessor started
            slot = self.slots.get(rank)
            return {"op": "snapshot", "snapshot": slot.snapshot if slot else None}, []
        if op == "forget":
            with self.lock:
                slot = self.slots.pop(rank, None)
            if slot is not None:
                slot.close()
            return {"op": "forgotten"}, []
        if op == "shutdown":
            return {"op": "bye", "pid": os.getpid()}, []
        return {"op": "error", "error": f"unknown op {op!r}"}, []

    def _persist(self, slot: Slot, msg: dict) -> dict:
        with slot.reading:
            return self._persist_read(slot, msg)

    def _persist_read(self, slot: Slot, msg: dict) -> dict:
        step, offset, length = msg["step"], msg["offset"], msg["length"]
        snapshot = {k: msg.get(k) for k in ("step", "key", "coords", "offset", "length", "version", "digest")}
        snapshot["state"] = "persisting"
        slot.snapshot = snapshot
        directory = self.storage.path(msg["dir"])
        path = f"{directory}/{msg['file']}"
        started = time.perf_counter()
        try:
            self.storage.fs.create_dir(directory, recursive=True)
            with memoryview(slot.view) as view:
                crc = write_file(self.storage, path, view[offset:offset + length])
        except Exception as e:  # storage full, unwritable, unreachable: report, commit nothing
            slot.snapshot = None
            try:
                self.storage.fs.delete_file(path)
            except Exception:
                pass
            log.error("step %d: persisting %s failed: %s: %s", step, path, type(e).__name__, e)
            return {"op": "persist_failed", "step": step, "error": f"{type(e).__name__}: {e}"}
        seconds = time.perf_counter() - started
        snapshot.update(state="persisted", crc32=crc)
        return {"op": "persisted", "step": step, "crc32": crc, "bytes": length, "seconds": seconds}

    def _hold(self, rank: int, slot: Slot, msg: dict) -> dict:
        """An in-memory snapshot the rank just wrote: checksummed, and sent to `msg["peer"]` (the next
        node's keeper) if any, while the rank trains on; it waits for the reply before overwriting it."""
        record = {k: msg[k] for k in ("step", "key", "coords", "length", "version", "digest")}
        peer, crc, error = msg.get("peer"), None, None
        with slot.reading:
            slot.snapshot = {**record, "offset": 0, "state": "holding"}
            started = time.perf_counter()
            with memoryview(slot.view) as view:
                image = view[:record["length"]]
                try:
                    if peer and self.replica_key:
                        crc = send_replica(peer, self.replica_key, rank, record, image,
                                           connected=lambda sock: setattr(slot, "sending", sock))
                except ReplicaError as e:
                    error = str(e)
                if crc is None:  # no peer, or it failed: the snapshot still counts on this node
                    crc = checksum(chunks_of(image))
                slot.snapshot.update(state="held", crc32=crc)
                try:
                    slot.keep_copy(image, dict(slot.snapshot))
                except OSError as e:  # out of memory for it: the buffer alone still holds this step
                    log.warning("rank %d: no copy of snapshot step %d kept: %s", rank, record["step"], e)
                image.release()
        return {"op": "held", "step": msg["step"], "crc32": crc, "seconds": time.perf_counter() - started,
                "replicated": peer if peer and error is None else None, "error": error}

    def _listen(self, msg: dict) -> dict:
        """Serves replicas on `msg["bind"]` (port `msg["port"]`, 0 = any) under `msg["key"]`. Under the lock: each
        rank's connection has a thread, and a node's ranks all ask at once when an incarnation starts. Without it
        several of them each started a server (4 addresses for one keeper, seen in `bench recovery --real`), the
        ring of keepers ran through one node's own servers, and a lost node took most of its replicas with it."""
        with self.lock:
            self.replica_key = bytes.fromhex(msg["key"])
            if self.replicas is None:
                try:
                    self.replicas = ReplicaServer(msg["bind"], msg["port"], lambda: self.replica_key)
                except OSError as e:
                    return {"op": "error", "error": f"cannot serve replicas on {msg['bind']}:{msg['port']}: {e}"}
                log.info("serving replicas on %s", self.replicas.address)
            return {"op": "listening", "address": self.replicas.address}

    def _commit(self, msg: dict) -> dict:
        step = msg["step"]
        try:
            write_manifest(self.storage, step, msg["manifest"])
        except Exception as e:
            log.error("step %d: writing the manifest failed: %s: %s", step, type(e).__name__, e)
            return {"op": "commit_failed", "step": step, "error": f"{type(e).__name__}: {e}"}
        self._drop_orphans(step)
        try:
            removed = apply_retention(self.storage, msg["keep"])
        except Exception as e:  # the commit stands; old checkpoints linger until the next one
            log.warning("step %d: retention failed: %s: %s", step, type(e).__name__, e)
            removed = []
        return {"op": "committed", "step": step, "removed": removed}


    def _drop_orphans(self, step: int) -> None:
        """Once step N is committed every current rank holds N: a disconnected slot holding less
        belongs to a rank of an earlier layout (e.g. before a DP resize) and is freed."""
        with self.lock:
            orphans = [r for r, slot in self.slots.items()
                       if not self.live[r] and (slot.snapshot or {}).get("step", -1) < step]
            for rank in orphans:
                self.slots.pop(rank).close()
        if orphans:
            log.info("freed the host snapshots of departed ranks %s", orphans)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megascale.checkpoint.keeper", description=__doc__)
    parser.add_argument("--uri", required=True, help="checkpoint.uri")
    parser.add_argument("--filesystem", help="checkpoint.filesystem: a registered file system's name")
    parser.add_argument("--filesystem-options", type=json.loads, default={},
                        help="checkpoint.filesystem_options as a JSON object")
    parser.add_argument("--idle-s", type=float, default=900.0, help="exit after this long with no rank connected")
    parser.add_argument("--log", help="this keeper's log file (stderr), deleted on a clean exit without warnings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper[%(process)d] %(levelname)s %(message)s")
    warned = _WarningFlag()
    logging.getLogger().addHandler(warned)
    uri = normalize_uri(args.uri)
    storage = open_storage(uri, args.filesystem, args.filesystem_options)
    Keeper(storage, ipc.socket_name(uri), args.idle_s, on_exit=lambda: _remove_quiet_log(args.log, warned.seen)).serve()


def _process(pid: Optional[str]) -> Optional[psutil.Process]:
    try:
        return psutil.Process(int(pid)) if pid else None
    except (ValueError, psutil.Error):
        return None


class _WarningFlag(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


def _remove_quiet_log(path: Optional[str], warned: bool) -> None:
    if path and not warned:  # nothing worth keeping: do not litter the temp directory
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    main()
