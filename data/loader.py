"""The node's loader process: reads shards once for the whole node, packs each step's batch for every
DP rank on the node, and writes it `depth` steps ahead into shared memory.

Protocol: one Unix stream socket per consumer rank, text lines both ways.

    rank -> loader   H <rank> <config fingerprint>   hello; answered "OK" + the memfd, or "E <why>"
                     S <gen> <first sequence>        (re)position: every load_state_dict starts a gen
                     C <gen> <n>                     batches 0..n-1 of gen copied: their slots are free
                     Q                               closing normally
    loader -> rank   P <gen> <n>                     batch n of gen is in slot n % depth
                     E <message>                     fatal; the rank raises DataError(message)

A gen starts once every consumer has asked for it (all ranks on a node resume together), so a
slot is only reused after every rank reading that gen has copied it. The socket doubles as a
liveness signal: a rank sees EOF when the loader dies, the loader sees EOF when a rank dies.
"""
from __future__ import annotations

import mmap
import os
import select
import socket
import sys
import time

from megascale.checkpoint.ipc import peer_uid
from megascale.data import DataError
from megascale.data.dataset import Dataset
from megascale.data.node import STATS, LoaderConfig
from megascale.data.stream import Stream

IDLE_POLL_S = 0.2  # how often an idle loader checks that its parent rank is alive
MAX_LINE = 4096


class _Rank:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.rank, self.buf = sock, None, b""
        self.gen, self.start, self.consumed, self.quit = 0, 0, 0, False


class Loader:
    def __init__(self, cfg: LoaderConfig, parent_pid: int) -> None:
        self.cfg, self.parent_pid = cfg, parent_pid
        self.layout = cfg.layout
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind("\0" + cfg.socket)
        except OSError:
            raise DataError("another data loader already serves this run directory and node "
                            f"(socket {cfg.socket})") from None
        self.listener.listen(len(cfg.consumers))
        self.fd = os.memfd_create("megascale-data", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.layout.total_bytes)
        self.buf = mmap.mmap(self.fd, self.layout.total_bytes)
        self.stats = self.layout.stats(self.buf)
        self.stats[STATS.index("loader_pid")] = os.getpid()
        self.ranks: dict[socket.socket, _Rank] = {}
        self.joined: dict[int, _Rank] = {}
        self.deadline = time.monotonic() + cfg.connect_timeout
        self.gen, self.start, self.next = 0, 0, 0
        self.fatal: str | None = None
        self.told: set[int] = set()  # ranks that have received the fatal error
        self.closed: set[int] = set()  # ranks that closed normally
        self.ds: Dataset | None = None
        self.stream: Stream | None = None

    # --- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.ds = Dataset(self.cfg.dataset)
            self.stream = Stream(self.ds, self.cfg.seed, self.cfg.window, holdout=self.cfg.holdout)
        except DataError as e:
            self.fatal = str(e)
        while True:
            if os.getppid() != self.parent_pid:  # the rank that started us has exited
                leader = self.cfg.consumers[0]
                if leader in self.closed:
                    return 0  # after closing normally: the job is over
                self._broadcast(f"E {self.fatal or self._died(leader)}")
                return 1
            ready = self._can_produce()
            socks = list(self.ranks) + ([self.listener] if self.listener else [])
            readable, _, _ = select.select(socks, [], [], 0 if ready else IDLE_POLL_S)
            for s in readable:
                if s is self.listener:
                    conn, _ = s.accept()
                    if peer_uid(conn) != os.getuid():  # abstract sockets have no file permissions
                        conn.close()
                        continue
                    self.ranks[conn] = _Rank(conn)
                else:
                    self._receive(self.ranks[s])
            if self.listener and len(self.joined) == len(self.cfg.consumers):
                self.listener.close()  # everyone is in: the name is free again
                self.listener = None
            elif self.listener and time.monotonic() > self.deadline and not self.fatal:
                missing = sorted(set(self.cfg.consumers) - set(self.joined))
                self.fatal = (f"ranks {missing} did not reach the node's data loader within "
                              f"{self.cfg.connect_timeout:.0f} s")
            if self.fatal:
                self._broadcast(f"E {self.fatal}")
                if not self.listener or self.told >= set(self.cfg.consumers) or time.monotonic() > self.deadline:
                    return 1
                continue  # keep answering late ranks with the error until all know or the deadline
            if not self.ranks and (self.listener is None or self.closed):
                return 0  # every rank that came has closed normally
            try:
                self._maybe_start_gen()
                if self._can_produce():
                    self._produce()
                elif self.gen and not self._prefetch():
                    self.stats[STATS.index("idle")] = 1  # all produced and read ahead: benchmarks wait for this
            except DataError as e:
                self.fatal = str(e)
            except Exception as e:  # noqa: BLE001 - report it to the ranks instead of leaving them waiting
                self.fatal = f"data loader failed: {type(e).__name__}: {e}"

    # --- messages --------------------------------------------------------------------------
    def _receive(self, r: _Rank) -> None:
        try:
            data = r.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(r)
            return
        r.buf += data
        while b"\n" in r.buf:
            line, r.buf = r.buf.split(b"\n", 1)
            try:
                self._handle(r, line.decode().split(" "))
            except (ValueError, IndexError):  # a malformed line (UnicodeDecodeError too): not the loader's end
                self._send(r, f"E malformed message {line[:40]!r}")
        if len(r.buf) > MAX_LINE:  # no line of this protocol is that long
            self._drop(r)

    def _handle(self, r: _Rank, msg: list[str]) -> None:
        kind = msg[0]
        if kind == "H":
            rank, fingerprint = int(msg[1]), msg[2]
            if self.fatal:
                why = self.fatal
                self.told.add(rank)
            elif rank not in self.cfg.consumers or rank in self.joined:
                why = f"rank {rank} is not an expected consumer of this node's data loader (or joined twice)"
            elif fingerprint != self.cfg.fingerprint():
                why = (f"rank {rank} has a different data configuration than the node's loader "
                       f"(rank {self.cfg.consumers[0]})")
            else:
                r.rank = rank
                self.joined[rank] = r
                socket.send_fds(r.sock, [b"OK\n"], [self.fd])
                return
            self._send(r, f"E {why}")
        elif kind == "S":
            r.consumed, r.start, r.gen = 0, int(msg[2]), int(msg[1])
        elif kind == "C" and int(msg[1]) == r.gen:
            r.consumed = max(r.consumed, int(msg[2]))
        elif kind == "Q":
            r.quit = True

    def _drop(self, r: _Rank) -> None:
        r.sock.close()
        del self.ranks[r.sock]
        if r.rank is None:
            return
        del self.joined[r.rank]
        if r.quit:
            self.closed.add(r.rank)
        elif not self.fatal:
            # A rank died (or was killed): fail its node peers now instead of letting them wait.
            self.fatal = self._died(r.rank)

    @staticmethod
    def _died(rank: int) -> str:
        return f"rank {rank} disconnected from the node's data loader without closing (did it die?)"

    def _send(self, r: _Rank, line: str) -> None:
        try:
            r.sock.sendall(line.encode() + b"\n")
        except OSError:
            pass  # its EOF arrives through select

    def _broadcast(self, line: str) -> None:
        for r in list(self.ranks.values()):
            self._send(r, line)
            if r.rank is not None:
                self.told.add(r.rank)
            r.sock.close()
            del self.ranks[r.sock]

    # --- production ------------------------------------------------------------------------
    def _maybe_start_gen(self) -> None:
        if self.listener is not None or not self.joined:
            return
        gens = [r.gen for r in self.joined.values()]
        if min(gens) <= self.gen:
            return
        gen = min(gens)
        starts = sorted({r.start for r in self.joined.values() if r.gen == gen})
        if len(starts) > 1:
            raise DataError(f"ranks on this node resumed at different samples {starts}: "
                            "they must load the same data state")
        self.gen, self.start, self.next = gen, starts[0], 0

    def _active(self) -> list[_Rank]:
        return [r for r in self.joined.values() if r.gen == self.gen]

    def _can_produce(self) -> bool:
        active = self._active() if self.gen and not self.fatal else []
        return bool(active) and self.next - min(r.consumed for r in active) < self.cfg.depth

    def _produce(self) -> None:
        cfg, n = self.cfg, self.next
        slot = n % cfg.depth
        self.stats[STATS.index("idle")] = 0
        first = self.start + n * cfg.batch_sequences
        before = self.ds.bytes_read
        for j, dp in enumerate(cfg.local_dps):
            arrays = self.stream.read_sequences(first + dp * cfg.rows, cfg.rows, cfg.seq)
            for view, values in zip(self.layout.block(self.buf, slot, j), arrays):
                view[:] = values
        self.layout.stamp(self.buf, slot)[:] = (self.gen, n)
        self._count(before, batches=1)
        self.next += 1
        for r in self._active():
            self._send(r, f"P {self.gen} {n}")  # a syscall: the slot's stores are visible before this

    def _prefetch(self) -> bool:
        """Ring full: use the idle time to read the next window before a step needs it; True if it read."""
        before = self.ds.bytes_read
        position = (self.start + self.next * self.cfg.batch_sequences) * self.cfg.seq
        self.stats[STATS.index("idle")] = 0
        if not self.stream.prefetch(position):
            return False
        self._count(before)
        return True

    def _count(self, bytes_before: int, batches: int = 0) -> None:
        self.stats[STATS.index("bytes_read")] += self.ds.bytes_read - bytes_before
        self.stats[STATS.index("windows_loaded")] = self.stream.loaded
        self.stats[STATS.index("batches")] += batches


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, parent = LoaderConfig.from_json(argv[0]), int(argv[1])
    try:
        loader = Loader(cfg, parent)
    except DataError as e:
        print(f"megascale data loader: {e}", file=sys.stderr)
        return 3
    return loader.run()


if __name__ == "__main__":
    sys.exit(main())
