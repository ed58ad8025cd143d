"""Keeper-to-keeper replication of in-memory snapshots (Gemini, SOSP '23): each node's keeper sends
its ranks' newest snapshots to the next node's keeper in ring order, which holds one replica per rank,
so a node that is lost takes no in-memory state with it. No torch here: the keeper imports it.

One request per TCP connection. The network is untrusted, so every message is authenticated with an
HMAC-SHA256 under the job's replica key and made fresh by the other side's random nonce (a recorded
message replays into nothing):

    server -> client   32-byte nonce Ns
    client -> server   request, MACed under Ns; its header carries the client's nonce Nc
    server -> client   reply, MACed under Nc

    message: [4-byte header length][header JSON][MAC(nonce | length | header)]
             [payload: header["length"] bytes][MAC(nonce | length | header | payload)]

The first MAC lets a receiver refuse a stranger before allocating anything for the payload. Requests:
`put` (a snapshot, replacing the held replica of its rank only once it verified), `stat` (what is held
for a rank) and `get` (its bytes). Authenticated, not encrypted: the training traffic itself is not
either. Snapshot bytes are checked twice: the MAC covers them in transit, and the CRC-32 recorded when
a replica arrived is checked by whoever fetches it (bit rot in between).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import socket
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import psutil

from megascale.checkpoint import ipc
from megascale.checkpoint.storage import CHUNK

log = logging.getLogger("megascale.checkpoint")
NONCE, MAC = 32, 32
MAX_HEADER = 64 << 10
IO_TIMEOUT_S = 60.0  # a peer silent this long mid-message is gone
MAX_CONNECTIONS = 64  # bounds the threads an unauthenticated flood can hold
RECORD_KEYS = {"step": int, "key": str, "coords": list, "length": int, "version": int, "digest": str}


class ReplicaError(RuntimeError):
    """A replica that could not be sent, fetched or verified; the text says why, in one line."""


def node_address() -> str:
    """The address other nodes reach this one at: the interface the ranks' gloo traffic uses
    (GLOO_SOCKET_IFNAME), else the one the default route leaves from, else loopback."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    for entry in psutil.net_if_addrs().get(name, []):
        if entry.family == socket.AF_INET:
            return entry.address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ReplicaError("the peer closed the connection mid-message (truncated)")
        view = view[got:]


def _send(sock: socket.socket, key: bytes, nonce: bytes, header: dict, payload: Optional[memoryview] = None) -> int:
    """Sends one message; returns the CRC-32 of its payload."""
    header = {**header, "length": len(payload) if payload is not None else 0}
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = len(head).to_bytes(4, "big") + head
    mac = hmac.new(key, nonce + prefix, hashlib.sha256)
    sock.sendall(prefix + mac.digest())
    crc = 0
    for at in range(0, header["length"], CHUNK):
        chunk = payload[at:at + CHUNK]
        mac.update(chunk)
        crc = zlib.crc32(chunk, crc)
        sock.sendall(chunk)
    sock.sendall(mac.digest())
    return crc


def _recv_header(sock: socket.socket, key: bytes, nonce: bytes) -> tuple[dict, hmac.HMAC]:
    """The next message's header, authenticated; the MAC to continue over its payload."""
    size = int.from_bytes(_recv_exact(sock, 4), "big")
    if size > MAX_HEADER:
        raise ReplicaError(f"refused: a {size}-byte header")
    head = _recv_exact(sock, size)
    mac = hmac.new(key, nonce + size.to_bytes(4, "big") + head, hashlib.sha256)
    if not hmac.compare_digest(mac.digest(), _recv_exact(sock, MAC)):
        raise ReplicaError("refused: bad MAC (another key, or altered in transit)")
    header = json.loads(head)
    if not isinstance(header, dict) or not isinstance(header.get("length"), int) or header["length"] < 0:
        raise ReplicaError("refused: malformed header")
    return header, mac


def _recv_payload(sock: socket.socket, mac: hmac.HMAC, into: Optional[memoryview]) -> int:
    """Receives the payload into `into` (exactly its size) and checks the closing MAC; returns its CRC-32."""
    crc = 0
    for at in range(0, len(into) if into is not None else 0, CHUNK):
        chunk = into[at:at + CHUNK]
        _recv_into(sock, chunk)
        mac.update(chunk)
        crc = zlib.crc32(chunk, crc)
    if not hmac.compare_digest(mac.digest(), _recv_exact(sock, MAC)):
        raise ReplicaError("refused: bad MAC over the snapshot (altered in transit, or torn)")
    return crc


def _valid_record(record) -> bool:
    return isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in RECORD_KEYS.items())


class _Request:
    """A client's side of one request: connects, takes the server's nonce, sends, reads the reply."""

    def __init__(self, address: str, key: bytes, timeout: float = IO_TIMEOUT_S,
                 connected: Callable[[socket.socket], None] = lambda sock: None):
        """`connected(sock)` is told the connection before the server's nonce is awaited: a frozen peer's kernel
        accepts the connection and the nonce never comes, and another thread must be able to cut that short."""
        self.key, self.nonce = key, os.urandom(NONCE)
        try:
            self.sock = socket.create_connection(_split(address), timeout=timeout)
            connected(self.sock)
            self.server_nonce = _recv_exact(self.sock, NONCE)
        except OSError as e:
            raise ReplicaError(f"keeper at {address} unreachable: {e}") from None
        self.address = address

    def __enter__(self) -> _Request:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, header: dict, payload: Optional[memoryview] = None) -> int:
        try:
            return _send(self.sock, self.key, self.server_nonce, {**header, "nonce": self.nonce.hex()}, payload)
        except OSError as e:
            raise ReplicaError(f"sending to the keeper at {self.address} failed: {e}") from None

    def reply(self, into: Optional[Callable[[dict], memoryview]] = None) -> tuple[dict, int]:
        """The server's reply header and the CRC-32 of its payload (received into `into(header)`)."""
        try:
            header, mac = _recv_header(self.sock, self.key, self.nonce)
            if not header.get("ok"):
                raise ReplicaError(f"the keeper at {self.address} refused: {header.get('error')}")
            target = into(header) if into is not None and header["length"] else None
            if (len(target) if target is not None else 0) != header["length"]:
                raise ReplicaError(f"the keeper at {self.address} sent {header['length']} bytes, "
                                   f"{len(target) if target is not None else 0} expected")
            return header, _recv_payload(self.sock, mac, target)
        except (OSError, ValueError) as e:
            raise ReplicaError(f"the reply of the keeper at {self.address} is unusable: {e}") from None


def send_replica(address: str, key: bytes, rank: int, record: dict, view: memoryview,
                 connected: Callable[[Optional[socket.socket]], None] = lambda sock: None) -> int:
    """Puts `view` (rank `rank`'s snapshot, described by `record`) to the keeper at `address`; returns
    the CRC-32 of what was sent once the peer verified and kept it. `connected(sock)` is told the
    connection while the send lasts (None after), so that another thread can cut it short."""
    try:
        with _Request(address, key, connected=connected) as request:
            crc = request.send({"op": "put", "rank": rank, "record": record}, view)
            header, _ = request.reply()
    finally:
        connected(None)
    if header.get("crc32") != crc:
        raise ReplicaError(f"the keeper at {address} holds CRC-32 {header.get('crc32')}, sent {crc}")
    return crc


def stat_replica(address: str, key: bytes, rank: int, timeout: float = 10.0) -> Optional[dict]:
    """The record of the replica the keeper at `address` holds for `rank`; None if it holds none."""
    with _Request(address, key, timeout) as request:
        request.send({"op": "stat", "rank": rank})
        header, _ = request.reply()
    record = header.get("record")
    return record if _valid_record(record) and isinstance(record.get("crc32"), int) else None


def fetch_replica(address: str, key: bytes, rank: int, step: int, into: Callable[[int], memoryview]) -> dict:
    """Fetches the replica of `rank`'s snapshot of `step` into `into(size)`; returns its record once its
    bytes match the CRC-32 taken when it arrived there. ReplicaError otherwise."""
    with _Request(address, key) as request:
        request.send({"op": "get", "rank": rank, "step": step})
        header, crc = request.reply(lambda h: into(h["length"]))
    record = header.get("record")
    if not _valid_record(record) or record["step"] != step or record["length"] != header["length"]:
        raise ReplicaError(f"the keeper at {address} sent a replica that is not rank {rank}'s of step {step}")
    if crc != record.get("crc32"):
        raise ReplicaError(f"the replica of rank {rank} at {address} fails its checksum (crc32 {crc:08x} != "
                           f"{record.get('crc32')}): corrupted in memory")
    return record


@dataclass
class Replica:
    """One rank's snapshot as received from its node's keeper."""

    fd: int
    view: mmap.mmap
    record: dict

    def close(self) -> None:
        ipc.close_mapping(self.view, self.fd)


class ReplicaServer:
    """A keeper's TCP side: holds the replicas of the previous node's ranks, one per rank."""

    def __init__(self, host: str, port: int, key: Callable[[], Optional[bytes]]):
        """`key()`: the replica key now (ranks may hand the keeper a new one at each start)."""
        self.key = key
        self.replicas: dict[int, Replica] = {}
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.server = socket.create_server((host, port), reuse_port=False)
        self.address = f"{host}:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="replica-server").start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            if not self.slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT_S)
            key = self.key()
            if key is None:
                return
            nonce = os.urandom(NONCE)
            conn.sendall(nonce)
            header, mac = _recv_header(conn, key, nonce)
            reply_nonce = bytes.fromhex(str(header.get("nonce", "")))
            rank = header.get("rank")
            if len(reply_nonce) != NONCE or not isinstance(rank, int):
                raise ReplicaError("refused: malformed request")
            op = header.get("op")
            if op == "put":
                reply, payload = self._put(conn, mac, rank, header), None
            elif op in ("stat", "get"):
                _recv_payload(conn, mac, None)
                reply, payload = self._lookup(rank, header.get("step") if op == "get" else None)
            else:
                raise ReplicaError(f"refused: unknown op {op!r}")
            try:
                _send(conn, key, reply_nonce, reply, payload)
            finally:
                if payload is not None:
                    payload.release()
        except (ReplicaError, OSError, ValueError) as e:
            log.warning("replica request refused: %s", e)
        finally:
            conn.close()
            self.slots.release()

    def _put(self, conn: socket.socket, mac: hmac.HMAC, rank: int, header: dict) -> dict:
        record, size = header.get("record"), header["length"]
        if not _valid_record(record) or record["length"] != size or size == 0:
            raise ReplicaError("refused: malformed snapshot record")
        fd = os.memfd_create("megascale-replica", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            view = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        new = Replica(fd, view, {**record, "state": "held"})
        try:
            with memoryview(view) as target:
                new.record["crc32"] = _recv_payload(conn, mac, target)
        except BaseException:
            new.close()  # the replica held so far stays: a torn one never replaces it
            raise
        with self.lock:
            old, self.replicas[rank] = self.replicas.get(rank), new
        if old is not None:
            old.close()
        return {"ok": True, "crc32": new.record["crc32"]}

    def _lookup(self, rank: int, step: Optional[int]) -> tuple[dict, Optional[memoryview]]:
        with self.lock:
            replica = self.replicas.get(rank)
            if step is None:
                return {"ok": True, "record": replica.record if replica else None}, None
            if replica is None or replica.record["step"] != step:
                held = replica.record["step"] if replica else None
                return {"ok": False, "error": f"no replica of rank {rank} at step {step} (holds {held})"}, None
            return {"ok": True, "record": replica.record}, memoryview(replica.view)

