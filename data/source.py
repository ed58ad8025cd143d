"""A rank's side of the node loader: `make_batch_source` and the BatchSource it returns.

The lowest consuming rank of each node starts the loader process (loader.py); every consuming
rank connects to it, maps the shared memory it is handed, and copies its DP rank's rows out of the
next slot. TP ranks of one DP rank copy the same rows; middle pipeline stages copy nothing.
"""
from __future__ import annotations

import mmap
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from megascale.checkpoint.ipc import ForeignPeer, check_server
from megascale.data import DataError
from megascale.data.dataset import Dataset
from megascale.data.node import (
    STATS,
    LoaderConfig,
    check_platform,
    coords,
    node_plan,
    socket_name,
)
from megascale.data.stream import Stream

CONNECT_TIMEOUT_S = 300.0  # followers wait this long for the leader's loader (it may be preparing text)
DATA_TIMEOUT_S = 600.0  # a batch that takes longer means a rank on the node stopped consuming
STATE_VERSION = 1
DEFAULTS = {"tokenizer": "byte", "prefetch": 4, "shuffle_window": 8}


class Batch(NamedTuple):
    input_ids: torch.Tensor  # int64 [rows, seq]
    labels: torch.Tensor  # int64 [rows, seq]; -100 where the next token starts another document
    position_ids: torch.Tensor  # int64 [rows, seq]: offset within the document (0 = a document starts)
    document_ids: torch.Tensor  # int64 [rows, seq]: equal ids = same document (mask attention with this)


def to_batch(tokens: np.ndarray, docs: np.ndarray, pos: np.ndarray) -> Batch:
    """[rows, seq + 1] tokens, document ids and positions -> a Batch; shifts, widens and masks with one copy
    per output, so views of shared memory are not kept."""
    input_ids = tokens[:, :-1].astype(np.int64)
    labels = tokens[:, 1:].astype(np.int64)
    labels[docs[:, 1:] != docs[:, :-1]] = -100  # never predict across a document boundary
    position_ids = pos[:, :-1].astype(np.int64)
    document_ids = docs[:, :-1].copy()
    return Batch(*(torch.from_numpy(a) for a in (input_ids, labels, position_ids, document_ids)))


class ShardBatchSource:
    """BatchSource over a prepared dataset; one per rank. Use as a context manager or call close()."""

    def __init__(self, ds: Dataset, stream: Stream, cfg: LoaderConfig, *, dp_rank: int, global_rank: int,
                 consumer: bool, leader: bool, node: int) -> None:
        self.ds, self.stream, self.cfg = ds, stream, cfg
        self.global_rank, self.node, self.dp_rank = global_rank, node, dp_rank
        self.wait_seconds = 0.0  # time next_batch spent waiting for the loader
        self._gen, self._start, self._n, self._published = 0, 0, 0, 0
        self._sock: socket.socket | None = None
        self._buf: mmap.mmap | None = None
        self._proc: subprocess.Popen | None = None
        self._lines = b""
        self._error: DataError | None = None  # once the loader failed, every later call says so
        self._consumer = consumer
        if not consumer:
            return
        self._j = cfg.local_dps.index(dp_rank)
        if leader:
            self._proc = _spawn_loader(cfg)
        try:
            self._connect()
            self._reposition(0)
        except BaseException:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()  # nobody will use it: don't let it wait out the connect timeout
            self.close()
            raise

    # --- BatchSource ------------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.next_sample()
        return batch.input_ids, batch.labels

    def next_sample(self) -> Batch:
        """The next step's rows for this rank, with the document ids and positions for masking."""
        if not self._consumer:
            self._n += 1  # a middle pipeline stage: only keep count
            empty = torch.empty((0, self.cfg.seq), dtype=torch.int64)
            return Batch(empty, empty, empty, empty)
        if self._error is not None:
            raise self._error
        if self._sock is None:
            raise DataError("next_batch() on a closed data source")
        n, slot = self._n, self._n % self.cfg.depth
        try:
            self._await(n)
        except DataError as e:
            self._error = e
            raise
        layout = self.cfg.layout
        batch = to_batch(*layout.block(self._buf, slot, self._j))  # views into shared memory, copied once
        stamp = tuple(layout.stamp(self._buf, slot))
        if stamp != (self._gen, n):
            raise DataError(f"shared-memory slot {slot} holds batch {stamp}, expected {(self._gen, n)} (loader bug)")
        self._send(f"C {self._gen} {n + 1}")
        self._n += 1
        return batch

    def state_dict(self) -> dict:
        sequence = self._start + self._n * self.cfg.batch_sequences
        return {
            "version": STATE_VERSION, "sequence": sequence, "seq": self.cfg.seq, "seed": self.cfg.seed,
            "holdout": self.cfg.holdout,
            "dataset": self.ds.fingerprint, **self.stream.describe(sequence, self.cfg.seq),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the checkpointed sample: every rank of a node must load the same state."""
        try:
            version, sequence = state["version"], int(state["sequence"])
            seq, seed, dataset = state["seq"], state["seed"], state["dataset"]
        except (KeyError, TypeError, ValueError):
            raise DataError(f"data state {state!r}: not a megascale data loader state") from None
        if version != STATE_VERSION:
            raise DataError(f"data state version {version}: this version reads {STATE_VERSION}")
        if dataset != self.ds.fingerprint:
            raise DataError(f"data state is for dataset {dataset}, data.path holds {self.ds.fingerprint} "
                            "(manifest mismatch)")
        if (seq, seed) != (self.cfg.seq, self.cfg.seed):
            raise DataError(f"data state has seq={seq} seed={seed}, "
                            f"the job has seq={self.cfg.seq} seed={self.cfg.seed}")
        holdout = state.get("holdout", 0.0)  # states saved before eval.split existed held nothing out
        if holdout != self.cfg.holdout:  # the same sequence number would name other samples
            raise DataError(f"data state has eval.split={holdout}, the job has eval.split={self.cfg.holdout}")
        self._reposition(sequence)

    def close(self) -> None:
        if self._sock is not None:
            self._send("Q")
            self._sock.close()
        if self._buf is not None:
            self._buf.close()
        if self._proc is not None:
            try:  # it exits once every rank of the node closed; if one lingers, its own exit ends it
                self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._sock = self._buf = self._proc = None

    def __enter__(self) -> ShardBatchSource:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- extras ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.ds.vocab_size

    @property
    def loader_pid(self) -> int | None:
        return self.stats().get("loader_pid")

    def stats(self) -> dict:
        """The node loader's counters (bytes read from shards, windows, batches) and this rank's wait."""
        out: dict = {"wait_seconds": self.wait_seconds}
        if self._buf is not None:
            values = self.cfg.layout.stats(self._buf)
            out.update({k: int(v) for k, v in zip(STATS, values)})
            del values
        return out

    # --- internals ---------------------------------------------------------------------------
    def _reposition(self, sequence: int) -> None:
        self._gen, self._start, self._n, self._published = self._gen + 1, sequence, 0, 0
        if self._sock is not None:
            self._send(f"S {self._gen} {sequence}")

    def _connect(self) -> None:
        deadline = time.monotonic() + self.cfg.connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect("\0" + self.cfg.socket)
                check_server(sock, f"the node {self.node} data loader's socket")
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
            except ForeignPeer as e:  # before a word is sent: it would feed this rank its data
                sock.close()
                raise DataError(str(e)) from None
            if self._proc is not None and self._proc.poll() is not None:
                raise DataError(f"the node {self.node} data loader exited with code {self._proc.returncode} "
                                "before accepting ranks (its error is on stderr)")
            if time.monotonic() > deadline:
                raise DataError(f"no data loader for node {self.node} after {self.cfg.connect_timeout:.0f} s "
                                f"(rank {self.cfg.consumers[0]} starts it: did it fail?)")
            time.sleep(0.02)
        self._sock = sock
        self._send(f"H {self.global_rank} {self.cfg.fingerprint()}")
        sock.settimeout(self.cfg.connect_timeout)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            while msg and not msg.endswith(b"\n"):
                more = sock.recv(4096)
                if not more:
                    break
                msg += more
        except TimeoutError:
            raise DataError(f"the node {self.node} data loader did not answer within "
                            f"{self.cfg.connect_timeout:.0f} s") from None
        sock.settimeout(None)
        if not msg.startswith(b"OK") or not fds:
            for fd in fds:
                os.close(fd)
            raise DataError(msg.decode(errors="replace")[2:].strip()
                            or f"node {self.node} data loader closed the connection")
        try:
            self._buf = mmap.mmap(fds[0], self.cfg.layout.total_bytes)
        finally:
            os.close(fds[0])  # the mapping keeps the memory; the descriptor is not needed

    def _await(self, n: int) -> None:
        t0 = time.perf_counter()
        deadline = t0 + DATA_TIMEOUT_S
        while self._published <= n:
            readable, _, _ = select.select([self._sock], [], [], 1.0)
            if readable:
                try:
                    data = self._sock.recv(65536)
                except OSError:  # reset: the loader died with our messages unread
                    data = b""
                if not data:
                    raise DataError(f"the node {self.node} data loader (pid {self.loader_pid}) died")
                self._lines += data
                while b"\n" in self._lines:
                    line, self._lines = self._lines.split(b"\n", 1)
                    kind, _, rest = line.decode().partition(" ")
                    if kind == "E":
                        raise DataError(rest)
                    gen, done = map(int, rest.split())
                    if kind == "P" and gen == self._gen:
                        self._published = max(self._published, done + 1)
            elif time.perf_counter() > deadline:
                raise DataError(f"no batch from the node {self.node} data loader for {DATA_TIMEOUT_S:.0f} s "
                                "(did a rank on this node stop consuming?)")
        self.wait_seconds += time.perf_counter() - t0

    def _send(self, line: str) -> None:
        try:
            self._sock.sendall(line.encode() + b"\n")
        except OSError:
            pass  # the loader is gone: the next wait reports it


def _spawn_loader(cfg: LoaderConfig) -> subprocess.Popen:
    # The child finds this checkout/installation the way this process did, whatever its cwd.
    import megascale

    env = dict(os.environ)
    root = str(Path(megascale.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "megascale.data.loader", cfg.to_json(), str(os.getpid())],
                            env=env, stdin=subprocess.DEVNULL)


def _field(data_cfg: Any, name: str) -> Any:
    return getattr(data_cfg, name, None) if getattr(data_cfg, name, None) is not None else DEFAULTS[name]


def open_dataset(source: str, path: str | os.PathLike, tokenizer: str, *, run_dir: str | os.PathLike,
                 vocab: int | None) -> Dataset:
    """The prepared dataset of `path`: a shards directory, or text prepared into run_dir once."""
    if source == "text":
        from megascale.data.prepare import prepare_cached

        root = prepare_cached(path, run_dir, tokenizer=tokenizer, vocab=vocab if tokenizer == "bpe" else None)
    else:
        root = Path(path)
    ds = Dataset(root)
    if vocab is not None and ds.vocab_size > vocab:
        raise DataError(f"{root}: tokenizer vocab_size={ds.vocab_size} exceeds model.vocab={vocab}")
    return ds


def make_batch_source(
    data_cfg: Any,
    *,
    seq: int,
    micro: int,
    microbatches: int,
    dp_rank: int,
    dp_size: int,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    global_rank: int,
    ranks_per_node: int | None = None,
    run_dir: str | os.PathLike,
    job_dir: str | os.PathLike | None = None,
    vocab: int | None = None,
    holdout: float = 0.0,
) -> ShardBatchSource | None:
    """This rank's batches for data.source "shards" (a prepared dir) or "text" (prepared into run_dir once).

    Returns None for "synthetic". `ranks_per_node` defaults to the whole world on one machine; `job_dir`
    (this run's own directory; default `run_dir`) names the node loaders' sockets, one per run and node;
    `vocab` (the model's) is checked against the tokenizer, and sizes the BPE for "text"; `holdout`
    (eval.split) is the share of documents kept out of training for validation.
    """
    source = data_cfg.source
    if source == "synthetic":
        return None
    if source not in ("text", "shards"):
        raise DataError(f"data.source={source!r}: must be synthetic, text or shards")
    if not data_cfg.path:
        raise DataError(f"data.path: required when data.source={source}")
    world = tp_size * dp_size * pp_size
    ranks_per_node = ranks_per_node or world
    if coords(global_rank, tp_size, dp_size) != (tp_rank, dp_rank, pp_rank) or global_rank >= world:
        raise DataError(f"rank {global_rank}: coordinates tp={tp_rank} dp={dp_rank} pp={pp_rank} do not match "
                        f"tp*dp*pp={tp_size}*{dp_size}*{pp_size}")
    depth, window, seed = _field(data_cfg, "prefetch"), _field(data_cfg, "shuffle_window"), data_cfg.seed
    if depth < 1:
        raise DataError(f"data.prefetch={depth}: must be >= 1 batch")
    check_platform()

    ds = open_dataset(source, data_cfg.path, _field(data_cfg, "tokenizer"), run_dir=run_dir, vocab=vocab)
    stream = Stream(ds, seed, window, holdout=holdout)
    rows = microbatches * micro
    stream.check_fill(seq, dp_size * rows)
    plan = node_plan(global_rank, ranks_per_node, tp_size, dp_size, pp_size)
    cfg = LoaderConfig(
        dataset=str(ds.root.resolve()), dataset_fingerprint=ds.fingerprint, seed=seed, window=stream.window,
        seq=seq, rows=rows, batch_sequences=dp_size * rows, depth=depth, local_dps=plan.local_dps,
        consumers=plan.consumers, socket=socket_name(str(job_dir or run_dir), plan.node),
        connect_timeout=CONNECT_TIMEOUT_S, holdout=holdout,
    )
    return ShardBatchSource(ds, stream, cfg, dp_rank=dp_rank, global_rank=global_rank, node=plan.node,
                            consumer=global_rank in plan.consumers, leader=global_rank == plan.leader)
