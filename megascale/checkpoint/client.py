"""A rank's side of the keeper: finding (or starting) it, and talking to it (the memory they share: host_buffer.py)."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megascale.checkpoint import ipc
from megascale.checkpoint.storage import CheckpointError, normalize_uri
from megascale.common.private_dir import ForeignDirectory, private_temp_dir

log = logging.getLogger("megascale.checkpoint")
CONNECT_TIMEOUT_S = 60.0  # a keeper starting on a loaded node needs a few seconds
_spawned: list[subprocess.Popen] = []  # kept so they are reaped, never waited on


class KeeperGone(CheckpointError):
    """The keeper process exited or closed the connection."""


class KeeperLink:
    """One rank's connection to its node's keeper; `snapshot` is what the keeper held at connect."""

    def __init__(self, uri: str, rank: int, filesystem: Optional[str] = None,
                 options: Optional[dict[str, str]] = None, idle_s: float = 900.0, spawn: bool = True):
        """`filesystem`, `options`: checkpoint.filesystem and its options, for a keeper this starts."""
        self.uri, self.rank = normalize_uri(uri), rank
        self.sock = _connect(self.uri, (filesystem, options or {}), idle_s, spawn)
        self.send({"op": "hello", "rank": rank})
        reply = self.recv(timeout=CONNECT_TIMEOUT_S)
        if reply is None:
            raise KeeperGone(f"keeper for {self.uri} did not answer within {CONNECT_TIMEOUT_S:.0f} s")
        hello, fds = reply
        self.pid: int = hello["pid"]
        self.snapshot: Optional[dict] = hello["snapshot"]
        self.snapshot_size: int = hello["size"]
        self.snapshot_fd: Optional[int] = fds[0] if fds else None
        # The keeper's copies of this rank's newest held snapshots: (record, memfd), read-only here.
        self.copies: list[tuple[dict, int]] = list(zip(hello.get("copies", []), fds[1:]))

    def send(self, obj: dict, fds: tuple[int, ...] = ()) -> None:
        try:
            ipc.send(self.sock, obj, fds)
        except OSError as e:
            raise KeeperGone(f"checkpoint keeper (pid {getattr(self, 'pid', '?')}) is gone: {e}") from None

    def recv(self, timeout: Optional[float] = None) -> Optional[tuple[dict, list[int]]]:
        try:
            return ipc.recv(self.sock, timeout)
        except (EOFError, OSError) as e:
            raise KeeperGone(f"checkpoint keeper (pid {getattr(self, 'pid', '?')}) is gone: {e}") from None

    def settled_snapshot(self, on_wait: Callable[[Optional[str]], None]) -> dict:
        """What the keeper holds for this rank once a persist still running from before a restart has
        ended ({} if nothing); `on_wait` learns what training waits for meanwhile, then None."""
        if (self.snapshot or {}).get("state") != "persisting":
            return dict(self.snapshot or {})
        on_wait(f"checkpoint step {self.snapshot['step']} to persist")
        waited = time.monotonic()
        try:
            while (self.snapshot or {}).get("state") == "persisting":
                if time.monotonic() - waited > 30:
                    log.warning("rank %d: waiting for the keeper to finish persisting step %d", self.rank,
                                self.snapshot["step"])
                    waited = time.monotonic()
                time.sleep(0.05)
                self.send({"op": "snapshot", "rank": self.rank})
                reply = self.recv(timeout=None)
                while reply[0]["op"] != "snapshot":  # nothing else is in flight before a restore
                    reply = self.recv(timeout=None)
                self.snapshot = reply[0]["snapshot"]
        finally:
            on_wait(None)
        return dict(self.snapshot or {})

    def take_snapshot_fd(self) -> Optional[int]:
        fd, self.snapshot_fd = self.snapshot_fd, None
        return fd

    def release_copies(self) -> None:
        """Closes the copies' fds once a restore is past them (the keeper reuses their memory)."""
        for _, fd in self.copies:
            os.close(fd)
        self.copies = []

    def close(self) -> None:
        if self.snapshot_fd is not None:
            os.close(self.snapshot_fd)
            self.snapshot_fd = None
        self.release_copies()
        self.sock.close()


def _connect(uri: str, filesystem: tuple[Optional[str], dict], idle_s: float, spawn: bool) -> socket.socket:
    name = ipc.socket_name(uri)
    deadline, lock = time.monotonic() + CONNECT_TIMEOUT_S, None
    try:  # holding the lock until connected: one spawn per node at a time
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(name)
                ipc.check_server(sock, f"the checkpoint keeper socket for {uri}")
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
            except ipc.ForeignPeer as e:  # before a word is sent: snapshots are the job's weights
                sock.close()
                raise CheckpointError(str(e)) from None
            if not spawn:
                raise KeeperGone(f"no checkpoint keeper serves {uri}")
            if lock is None:
                lock = _spawn_lock(name)
                if lock is not None:  # this rank starts the keeper; the node's other ranks wait for it
                    _spawn(uri, filesystem, idle_s)
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint keeper for {uri} did not start within {CONNECT_TIMEOUT_S:.0f} s "
                                      f"(see {_log_path(uri)})")
            time.sleep(0.05)
    finally:
        if lock is not None:
            lock.close()


def _spawn_lock(name: str) -> Optional[socket.socket]:
    """An abstract socket bound as a lock: only its holder starts a keeper, so two never race to
    bind (a late starter could bind after the first exits and linger). The kernel releases it if
    the holder dies. None while another process holds it."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        lock.bind(name + "-spawn")
        return lock
    except OSError:
        lock.close()
        return None


def _log_path(uri: str) -> Path:
    try:
        return private_temp_dir() / f"keeper-{ipc.socket_name(uri)[18:]}.log"
    except ForeignDirectory as e:
        raise CheckpointError(f"the checkpoint keeper's log: {e}") from None


def _spawn(uri: str, filesystem: tuple[Optional[str], dict], idle_s: float) -> None:
    root = str(Path(__file__).resolve().parents[2])  # so the keeper imports this same checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    log_path = _log_path(uri)
    command = [sys.executable, "-m", "megascale.checkpoint.keeper", "--uri", uri, "--idle-s", str(idle_s),
               "--log", str(log_path)]
    name, options = filesystem
    if name:  # a registered name and plain options: the keeper resolves them as open_storage does
        command += ["--filesystem", name, "--filesystem-options", json.dumps(options)]
    with open(log_path, "ab") as out:
        # Its own session: it must outlive the ranks and ignore the terminal's Ctrl-C.
        _spawned.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                         start_new_session=True))
    for proc in list(_spawned):
        if proc.poll() is not None:
            _spawned.remove(proc)


def shutdown_keeper(uri: str) -> Optional[int]:
    """Stops the keeper serving `uri` (dropping its host snapshots); returns its pid, None if none ran."""
    try:
        sock = _connect(normalize_uri(uri), (None, {}), 0, spawn=False)
    except KeeperGone:
        return None
    try:
        ipc.send(sock, {"op": "shutdown"})
        reply = ipc.recv(sock, timeout=10)
    except (EOFError, OSError):
        reply = None
    finally:
        sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until its socket is gone, so the next connect cannot reach it
        try:
            _connect(normalize_uri(uri), (None, {}), 0, spawn=False).close()
        except KeeperGone:
            break
        time.sleep(0.02)
    return reply[0]["pid"] if reply else None
