"""Messages between a rank and its node's keeper: JSON over a Unix SOCK_SEQPACKET socket
(one message per packet), with file descriptors (shared-memory snapshots) passed by SCM_RIGHTS.

Only JSON crosses the socket: nothing is ever unpickled. Tensor bytes never do either; they
stay in shared memory that both sides map.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import struct
from typing import Optional

MAX_INLINE = 32 << 10  # larger messages travel in a memfd passed with the packet
MAX_FDS = 8


def socket_name(uri: str) -> str:
    """The keeper's abstract socket for a checkpoint URI (per user and node; gone when the keeper exits).

    MEGASCALE_NODE (set by the executor) keeps the simulated nodes of a one-machine job apart, as
    separate machines would be: each has its own keeper and loses its host snapshots with it."""
    digest = hashlib.sha256(f"{os.getuid()}:{os.environ.get('MEGASCALE_NODE', '')}:{uri}".encode()).hexdigest()[:24]
    return f"\0megascale-keeper-{digest}"


def send(sock: socket.socket, obj: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    blob = None
    if len(data) > MAX_INLINE:
        blob = os.memfd_create("megascale-message", os.MFD_CLOEXEC)
        view = memoryview(data)
        while view:
            view = view[os.write(blob, view):]
        data, fds = json.dumps({"$blob": len(data)}).encode(), [blob, *fds]
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendmsg([data])
    finally:
        if blob is not None:
            os.close(blob)


def recv(sock: socket.socket, timeout: Optional[float] = None) -> Optional[tuple[dict, list[int]]]:
    """The next message and its fds; None after `timeout` seconds; EOFError once the peer is gone."""
    if timeout is not None and not select.select([sock], [], [], timeout)[0]:
        return None
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_INLINE + 1024, MAX_FDS)
    except ConnectionResetError:
        raise EOFError("peer reset the connection") from None
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("peer closed the connection")
    obj = json.loads(data)
    if "$blob" in obj:
        blob = fds.pop(0)
        try:
            raw = os.pread(blob, obj["$blob"], 0)
        finally:
            os.close(blob)
        obj = json.loads(raw)
    return obj, fds


class ForeignPeer(PermissionError):
    """The process at the other end of a local socket runs as another user."""


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED: struct ucred)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def check_server(sock: socket.socket, what: str) -> None:
    """ForeignPeer (one line) unless the server `sock` connected to runs as this user. Abstract sockets
    have no file permissions: another local user can bind a name first and wait for our data."""
    uid = peer_uid(sock)
    if uid != os.getuid():
        raise ForeignPeer(f"{what} is held by uid {uid}, not by this user (uid {os.getuid()}): refusing it "
                          "(another local user bound its name first)")


def close_mapping(mapping, fd: int) -> None:
    """Closes a shared-memory mapping and its file descriptor; a mapping some view still refers to
    goes with the last reference instead."""
    try:
        mapping.close()
    except BufferError:
        pass
    os.close(fd)
