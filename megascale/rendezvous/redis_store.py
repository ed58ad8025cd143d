"""A torch.distributed Store backed by Redis, where the server does the waiting.

Layout: every store key is a one-element Redis *list* under `megascale:{<job>/<incarnation>}:`.
A blocking get is `BRPOPLPUSH key key t`: it pops the element and pushes it straight back,
atomically, so the value stays put, the call returns the moment the key exists, and every
client blocked on the key is woken by the one write. No client ever polls. Writes are small
Lua scripts, so each one is atomic and one round trip. The braces are a Redis Cluster hash
tag, keeping one job's keys in one slot as multi-key scripts would need there.

Incarnations isolate restarts: a restarted job uses a new incarnation, so it can never read
keys from a previous attempt. A Redis restart (memory lost) is detected on reconnect through
an epoch key that every connection checks, and reported instead of waiting on keys that
will never come back.

Each thread talks over its own redis-py Connection, not a pool: a pool checkout costs extra
system calls per command, and a blocked get must not hold up another thread's set.
"""
from __future__ import annotations

import hashlib
import inspect
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterable
from datetime import timedelta

import redis
import torch.distributed as dist
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from megascale.common.errors import first_line
from megascale.common.redis_keys import namespace

# Blocking calls are cut into slices so a silent network partition still surfaces as a socket
# timeout; a re-issue every few seconds is not polling in any meaningful sense. The timeout is
# the kernel's (SO_RCVTIMEO): a Python-level socket timeout costs a poll() per read and write.
BLOCK_SLICE_S = 10.0
SOCKET_TIMEOUT_S = BLOCK_SLICE_S + 10.0
# A connection unused this long is checked for a server hang-up before the next command.
IDLE_CHECK_S = 1.0
# The first connection is retried 0.05 s, 0.1 s, ... then every 1 s apart until connect_timeout.
CONNECT_BACKOFF = ExponentialBackoff(cap=1.0, base=0.025)
# A command whose send failed never reached the server: one resend on a fresh connection is safe.
# (A reply lost after the send is never retried: the command may have run, an add twice.)
RESEND_ONCE = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))

_SET_ONE = "redis.call('DEL', k); redis.call('RPUSH', k, v); redis.call('SADD', KEYS[1], k)"
SCRIPTS = {
    "set": f"local k, v = KEYS[2], ARGV[1]; {_SET_ONE}",
    "multi_set": f"for i = 2, #KEYS do local k, v = KEYS[i], ARGV[i - 1]; {_SET_ONE} end",
    "add": f"""
local cur = redis.call('LINDEX', KEYS[2], 0)
if cur and not tonumber(cur) then return redis.error_reply('value is not an integer') end
local n = (tonumber(cur) or 0) + tonumber(ARGV[1])
local k, v = KEYS[2], string.format('%d', n); {_SET_ONE}
return n""",
    # torch semantics: a missing key is created only when expected is empty; the reply is the
    # value now stored if the swap happened, else the current value (or `expected` if missing).
    "compare_set": f"""
local cur = redis.call('LINDEX', KEYS[2], 0)
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  local k, v = KEYS[2], ARGV[2]; {_SET_ONE}
  return ARGV[2]
end
return cur or ARGV[1]""",
    "append": f"local k, v = KEYS[2], (redis.call('LINDEX', KEYS[2], 0) or '') .. ARGV[1]; {_SET_ONE}",
    "delete": "redis.call('SREM', KEYS[1], KEYS[2]); return redis.call('DEL', KEYS[2])",
}
_SHA = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in SCRIPTS.items()}
# Skip CLIENT SETINFO on connect (an extra round trip, and an error before Redis 7.2).
_NO_CLIENT_INFO = ({"driver_info": None} if "driver_info" in inspect.signature(redis.Connection.__init__).parameters
                   or "driver_info" in inspect.signature(redis.connection.AbstractConnection.__init__).parameters
                   else {"lib_name": None, "lib_version": None})


class RendezvousError(dist.DistStoreError):
    """Redis unreachable, restarted, or too slow: a one-line message naming what to fix."""

    cause = ""  # the underlying client error, when there is one


class RendezvousTimeout(RendezvousError):
    """A key did not appear in time: some rank has not arrived (or used another job/incarnation)."""


class RedisRestarted(redis.ConnectionError):
    """Raised on (re)connect when the server no longer holds this job's epoch key."""


INDEX, EPOCH, KEY_PREFIX = "__keys__", "__epoch__", "k:"


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | float | None) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)


def pack(commands: list[tuple]) -> bytes:
    """RESP-encode commands into one buffer (redis-py's packer is several times slower)."""
    out = []
    for args in commands:
        out.append(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, (int, float)):
                arg = repr(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def _secs(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def _not_restarted(e: BaseException) -> bool:
    """A restarted server lost the job's keys: resending cannot help."""
    return not isinstance(e, RedisRestarted)


class RedisStore(dist.Store):
    """`torch.distributed.Store` on Redis; pass it to `init_process_group(store=...)`.

    Keys live under (job, incarnation): start every restart with a new incarnation.
    `timeout` bounds blocking get/wait (0 = wait forever); `connect_timeout` (default: the
    same) bounds retrying the first connection.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        job: str = "default",
        incarnation: str | int = 0,
        timeout: timedelta = timedelta(seconds=300),
        *,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        connect_timeout: timedelta | None = None,
        tls: dict | None = None,
    ) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self.host, self.port, self.db = host, port, db
        self._username, self._password = username, password
        self._tls = tls  # redis.SSLConnection's ssl_* options; None: plain TCP
        self.job, self.incarnation = job, str(incarnation)
        self._connect_timeout = connect_timeout
        self._ns = namespace(job, self.incarnation)
        self._index = self._ns + INDEX
        self._epoch_key = self._ns + EPOCH
        self._epoch: bytes | None = None
        self._local = threading.local()
        self._conns: weakref.WeakSet = weakref.WeakSet()
        self._connect()

    # -- connections and errors --------------------------------------------------------------

    def _new_connection(self) -> redis.Connection:
        kind, tls = (redis.Connection, {}) if self._tls is None else (redis.SSLConnection, self._tls)
        conn = kind(
            host=self.host, port=self.port, db=self.db, username=self._username, password=self._password,
            socket_timeout=None, socket_connect_timeout=5, socket_keepalive=True,
            # Retrying silently would hide a restarted server; every failure surfaces instead.
            retry=Retry(NoBackoff(), 0), redis_connect_func=self._on_connect, **_NO_CLIENT_INFO, **tls)
        self._conns.add(conn)
        return conn

    def _on_connect(self, conn: redis.Connection) -> None:
        """Runs on every (re)connect: adopt the job's epoch once, then insist it is unchanged."""
        seconds = int(SOCKET_TIMEOUT_S)
        timeval = struct.pack("ll", seconds, int((SOCKET_TIMEOUT_S - seconds) * 1e6))
        conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        conn.on_connect()
        conn.send_packed_command(conn.pack_commands([
            ("SETNX", self._epoch_key, secrets.token_hex(8)), ("GET", self._epoch_key)]))
        created, epoch = conn.read_response(), conn.read_response()
        if self._epoch is None:
            self._epoch = epoch
        elif created or epoch != self._epoch:
            raise RedisRestarted("Redis lost this job's keys (server restarted or flushed)")

    def _connect(self) -> None:
        limit = _seconds(self._connect_timeout if self._connect_timeout is not None else self.timeout)
        deadline = time.monotonic() + (limit or float("inf"))

        def give_up_at_deadline(e: RendezvousError, failures: int) -> None:
            if time.monotonic() + CONNECT_BACKOFF.compute(failures) > deadline:
                raise RendezvousError(
                    f"cannot reach Redis at {self.host}:{self.port} within {_secs(limit)} "
                    f"({e.cause}): start Redis or fix the redis:// address") from None

        # retries=-1: as many as the deadline allows, which give_up_at_deadline enforces.
        Retry(CONNECT_BACKOFF, -1, supported_errors=(RendezvousError,)).call_with_retry(
            lambda: self._pipeline("connect", [("PING",)]), give_up_at_deadline, with_failure_count=True)

    def _connection(self) -> redis.Connection:
        """This thread's connection; after a quiet spell, first drop it if the server hung up
        (an idle timeout or a restart), so the reconnect's epoch check runs before we send."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = self._new_connection()
        elif time.monotonic() - local.used > IDLE_CHECK_S and conn._sock is not None:
            try:
                stale = conn.can_read(timeout=0)
            except (redis.ConnectionError, OSError):
                stale = True
            if stale:
                conn.disconnect()
        local.used = time.monotonic()
        return conn

    def _pipeline(self, what: str, commands: list[tuple]) -> list:
        """Send `commands` in one write, read every reply; errors come back as one-line messages."""
        conn = self._connection()
        packed = [pack(commands)]  # a list: send_packed_command iterates its argument
        try:
            RESEND_ONCE.call_with_retry(lambda: conn.send_packed_command(packed, check_health=False),
                                        lambda _: conn.disconnect(), is_retryable=_not_restarted)
            replies = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as e:
                    replies.append(e)
            self._local.used = time.monotonic()
            return replies
        except RedisRestarted:
            conn.disconnect()
            raise RendezvousError(
                f"Redis at {self.host}:{self.port} restarted during {what} (job {self.job!r}, "
                f"incarnation {self.incarnation}): its keys are gone; restart the job with a new incarnation"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            # A reply lost mid-command is not retried: the command may have run (an add twice).
            conn.disconnect()
            cause = first_line(e)
            if "Resource temporarily unavailable" in cause:  # the kernel socket timeout fired
                cause = f"no reply within {SOCKET_TIMEOUT_S:g} s"
            error = RendezvousError(
                f"lost Redis at {self.host}:{self.port} during {what} (job {self.job!r}, "
                f"incarnation {self.incarnation}): {cause}; check the server, then restart the job")
            error.cause = cause
            raise error from None

    def _cmd(self, what: str, *args):
        reply = self._pipeline(what, [args])[0]
        if isinstance(reply, redis.ResponseError):
            raise dist.DistStoreError(f"Redis refused {what}: {first_line(reply)}")
        return reply

    def _script(self, name: str, what: str, keys: list[str], args: list = ()):
        reply = self._pipeline(what, [("EVALSHA", _SHA[name], len(keys), *keys, *args)])[0]
        if isinstance(reply, redis.exceptions.NoScriptError):  # first use on this server: send the source once
            return self._cmd(what, "EVAL", SCRIPTS[name], len(keys), *keys, *args)
        if isinstance(reply, redis.ResponseError):
            raise dist.DistStoreError(f"Redis refused {what}: {first_line(reply)}")
        return reply

    def _k(self, key: str) -> str:
        return self._ns + KEY_PREFIX + key

    def _timeout_error(self, keys: Iterable[str], seconds: float) -> RendezvousTimeout:
        shown = ", ".join(list(keys)[:3])
        return RendezvousTimeout(
            f"Timeout after {_secs(seconds)} waiting for key(s) [{shown}] (job {self.job!r}, "
            f"incarnation {self.incarnation}): a rank has not arrived; "
            "check every rank started with this job/incarnation")

    # -- torch.distributed.Store API ---------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._script("set", f"set {key!r}", [self._index, self._k(key)], [_bytes(value)])

    def get(self, key: str) -> bytes:
        """The value of `key`, blocking until some rank sets it (up to the store timeout)."""
        limit = _seconds(self.timeout)
        value = self._block_on(key, limit)
        if value is None:
            raise self._timeout_error([key], limit)
        return value

    def add(self, key: str, value: int) -> int:
        return int(self._script("add", f"add {key!r}", [self._index, self._k(key)], [int(value)]))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._script("compare_set", f"compare_set {key!r}", [self._index, self._k(key)],
                            [_bytes(expected_value), _bytes(desired_value)])

    def append(self, key: str, value: str | bytes) -> None:
        self._script("append", f"append {key!r}", [self._index, self._k(key)], [_bytes(value)])

    def check(self, keys: list[str]) -> bool:
        unique = list(dict.fromkeys(self._k(k) for k in keys))
        return not unique or self._cmd("check", "EXISTS", *unique) == len(unique)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists: one pipelined existence check, then server-side waits."""
        if not keys:
            return
        limit = _seconds(self.timeout if timeout is None else timeout)
        deadline = time.monotonic() + limit if limit else None
        # One key: block on it straight away (it returns at once if the key exists).
        missing = list(keys) if len(keys) == 1 else self._missing(keys)
        for i, key in enumerate(missing):
            left = 0.0 if deadline is None else deadline - time.monotonic()  # 0: forever
            if deadline is not None and left <= 0 or self._block_on(key, left) is None:
                raise self._timeout_error(missing[i:], limit)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        self.wait(keys)
        return self._pipeline("multi_get", [("LINDEX", self._k(k), 0) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._script("multi_set", "multi_set", [self._index] + [self._k(k) for k in keys], [_bytes(v) for v in values])

    def delete_key(self, key: str) -> bool:
        return bool(self._script("delete", f"delete_key {key!r}", [self._index, self._k(key)]))

    def num_keys(self) -> int:
        return int(self._cmd("num_keys", "SCARD", self._index))

    def has_extended_api(self) -> bool:
        return True

    # torch's C++ trampoline (used by PrefixStore, which init_process_group always wraps
    # around a store) looks these up by their C++ names.
    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    def getNumKeys(self) -> int:
        return self.num_keys()

    def clone(self) -> RedisStore:
        return RedisStore(self.host, self.port, self.job, self.incarnation, self.timeout, username=self._username,
                          password=self._password, db=self.db, connect_timeout=self._connect_timeout, tls=self._tls)

    # -- helpers -----------------------------------------------------------------------------

    def _missing(self, keys: list[str]) -> list[str]:
        found = self._pipeline("wait", [("EXISTS", self._k(k)) for k in keys])
        return [k for k, n in zip(keys, found) if not n]

    def _block_on(self, key: str, seconds: float) -> bytes | None:
        """Server-side wait for `key`: its value, or None after `seconds` (0 = forever)."""
        rkey = self._k(key)
        deadline = time.monotonic() + seconds if seconds else None
        while True:
            left = BLOCK_SLICE_S if deadline is None else min(BLOCK_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return None
            # Redis reads a 0 timeout as "forever"; never send one by accident.
            value = self._cmd(f"wait for {key!r}", "BRPOPLPUSH", rkey, rkey, max(round(left, 3), 0.001))
            if value is not None:
                return value

    def purge(self) -> int:
        """Delete every key of this job incarnation (once the job is over); returns how many."""
        keys = self._cmd("purge", "SMEMBERS", self._index)
        for batch in [list(keys)[i:i + 1000] for i in range(0, len(keys), 1000)]:
            self._cmd("purge", "DEL", *batch)
        return len(keys) + self._cmd("purge", "DEL", self._index, self._epoch_key)

    def close(self) -> None:
        """Close every connection this store opened (from any thread)."""
        for conn in list(self._conns):
            conn.disconnect()
