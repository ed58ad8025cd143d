"""The global sample order: a pure function of (dataset, seed), so any process can find any sample.

Epoch e's token stream is every document once, shuffled at two levels that keep reads sequential:
the shard order is permuted (seeded by seed, e), consecutive shards are grouped into windows of
`window` shards, and the documents of a window are permuted together (seeded by seed, e, w).
Epochs follow each other without a gap. Sequence k is stream[k*seq : k*seq + seq + 1]: neighbours
overlap by one token, so every token but the very first is a label exactly once per epoch.

Because the order is a function of the sample number, loader state is one integer: the next
global sequence. Epoch, window and offset are derived from it, and the "RNG state" is (seed, epoch).

With `holdout` (eval.split) a fixed share of the documents is held out for validation: the training
stream skips them and a `read_held_out` stream reads only them, in the same two-level order.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np
from megascale.data import DataError
from megascale.data.dataset import Dataset

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def permutation(n: int, *key: int) -> np.ndarray:
    """A seeded shuffle of range(n) defined here, not by numpy's RNG, so no library upgrade changes
    the order a checkpoint resumes into: sort by a splitmix64 hash of (key, index)."""
    h = 0
    for k in key:
        h = _mix(h ^ (k & _MASK))
    z = np.arange(n, dtype=np.uint64) + np.uint64(h) + np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.argsort(z ^ (z >> np.uint64(31)), kind="stable")


# The held-out documents depend on the dataset alone: not on data.seed, so changing the shuffle never moves
# a document between training and validation.
HOLDOUT_KEY = 0x5EED0E7A1


def held_out_documents(documents: int, fraction: float) -> np.ndarray:
    """bool [documents]: the validation documents, ceil(fraction * documents) of them, by a fixed shuffle."""
    count = int(np.ceil(fraction * documents))
    if not 0 < count < documents:
        raise DataError(f"eval.split={fraction}: holds out {count} of the dataset's {documents} documents; "
                        "both validation and training need at least one")
    held = np.zeros(documents, dtype=bool)
    held[permutation(documents, HOLDOUT_KEY)[:count]] = True
    return held


class _Window(NamedTuple):
    tokens: np.ndarray  # the window's documents, permuted and concatenated
    starts: np.ndarray  # int64 [docs + 1]: where each document starts in `tokens`
    doc_ids: np.ndarray  # int64 [docs]: manifest document number of each


class Stream:
    def __init__(self, ds: Dataset, seed: int, window: int, cache: int = 3, *, holdout: float = 0.0,
                 read_held_out: bool = False) -> None:
        if seed < 0:
            raise DataError(f"data.seed={seed}: must be >= 0")
        if window < 1:
            raise DataError(f"data.shuffle_window={window}: must be >= 1 shard")
        self.ds, self.seed = ds, seed
        self.window = min(window, len(ds.shards))
        self.epoch_tokens = ds.tokens
        self._shard_tokens = ds.shard_tokens
        self._keep: np.ndarray | None = None  # bool per document; None = every document
        if holdout:
            held = held_out_documents(ds.documents, holdout)
            self._keep = held if read_held_out else ~held
            kept = np.where(self._keep, ds.document_tokens(), 0)
            self._shard_tokens = np.add.reduceat(kept, [s.first_doc for s in ds.shards])
            self.epoch_tokens = int(self._shard_tokens.sum())
        self._cache: OrderedDict[tuple[int, int], _Window] = OrderedDict()
        self._cache_size = cache
        self._epoch: tuple[int, list[np.ndarray], np.ndarray] | None = None
        self.loaded = 0  # windows read so far

    def check_fill(self, seq: int, batch_sequences: int) -> None:
        """Errors when one sequence or one global batch would need more than an epoch of tokens."""
        if seq + 1 > self.epoch_tokens:
            raise DataError(f"seq={seq}: a sequence needs {seq + 1} tokens, the dataset holds only {self.epoch_tokens}")
        if batch_sequences * seq + 1 > self.epoch_tokens:
            raise DataError(f"seq={seq}: one global batch of {batch_sequences} sequences needs "
                            f"{batch_sequences * seq + 1} tokens, the dataset holds only {self.epoch_tokens}")

    def windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Shard numbers of each window of `epoch`, and the windows' cumulative token bounds."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = permutation(len(self._shard_tokens), self.seed, epoch, 0)
            groups = [order[i:i + self.window] for i in range(0, len(order), self.window)]
            bounds = np.zeros(len(groups) + 1, dtype=np.int64)
            np.cumsum([self._shard_tokens[g].sum() for g in groups], out=bounds[1:])
            self._epoch = (epoch, groups, bounds)
        return self._epoch[1], self._epoch[2]

    def locate(self, position: int) -> tuple[int, int, int]:
        """(epoch, window, offset in window) of a token position in the endless stream."""
        epoch, offset = divmod(position, self.epoch_tokens)
        _, bounds = self.windows(epoch)
        w = int(np.searchsorted(bounds, offset, side="right")) - 1
        return epoch, w, offset - int(bounds[w])

    def _window(self, epoch: int, w: int) -> _Window:
        key = (epoch, w)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        groups, _ = self.windows(epoch)
        tokens, lengths, firsts, ids, base = [], [], [], [], 0
        for shard in groups[w]:
            toks, offsets = self.ds.read_shard(int(shard))
            tokens.append(toks)
            lengths.append(np.diff(offsets))
            firsts.append(offsets[:-1] + base)
            ids.append(self.ds.shards[shard].first_doc + np.arange(len(offsets) - 1))
            base += len(toks)
        flat, length, first, doc_ids = (np.concatenate(a) for a in (tokens, lengths, firsts, ids))
        if self._keep is not None:
            kept = self._keep[doc_ids]
            length, first, doc_ids = length[kept], first[kept], doc_ids[kept]
        perm = permutation(len(length), self.seed, epoch, 1, w)
        # A loop over documents, not a gather index: that index would cost 8 bytes per token.
        packed = np.concatenate([flat[:0]] + [flat[a:a + n] for a, n in zip(first[perm], length[perm])])
        starts = np.zeros(len(perm) + 1, dtype=np.int64)
        np.cumsum(length[perm], out=starts[1:])
        self._cache[key] = win = _Window(packed, starts, doc_ids[perm])
        self.loaded += 1
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return win

    def read(self, position: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens [position, position+n) with, per token, its document id and position in the document.

        Document ids are unique per occurrence (epoch * documents + manifest number), so a document
        that ends one epoch and starts the next still reads as two documents.
        """
        tokens = np.empty(n, dtype=np.int32)
        docs = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int32)
        done = 0
        while done < n:
            epoch, w, offset = self.locate(position + done)
            win = self._window(epoch, w)
            take = min(n - done, len(win.tokens) - offset)
            idx = np.arange(offset, offset + take)
            d = np.searchsorted(win.starts, idx, side="right") - 1
            tokens[done:done + take] = win.tokens[offset:offset + take]
            docs[done:done + take] = epoch * self.ds.documents + win.doc_ids[d]
            pos[done:done + take] = idx - win.starts[d]
            done += take
        return tokens, docs, pos

    def read_sequences(self, first: int, count: int, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequences first..first+count-1, each [seq + 1]: one contiguous read, overlapping rows."""
        arrays = self.read(first * seq, count * seq + 1)
        return tuple(np.lib.stride_tricks.sliding_window_view(a, seq + 1)[::seq][:count] for a in arrays)

    def prefetch(self, position: int) -> bool:
        """Loads the window holding `position`, else the one after it; True if that read anything."""
        epoch, w, _ = self.locate(position)
        groups, _ = self.windows(epoch)
        following = (epoch, w + 1) if w + 1 < len(groups) else (epoch + 1, 0)
        for key in ((epoch, w), following):
            if key not in self._cache:
                self._window(*key)
                return True
        return False

    def describe(self, sequence: int, seq: int) -> dict:
        """Human-readable place of a sequence, stored beside the authoritative sequence number."""
        epoch, w, offset = self.locate(sequence * seq)
        groups, _ = self.windows(epoch)
        return {"epoch": epoch, "window": w, "shards": [int(s) for s in groups[w]], "offset": offset,
                "rng": [self.seed, epoch, 1, w]}  # the seed of this window's document shuffle
