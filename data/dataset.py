"""A prepared dataset directory: `manifest.json`, token shards, and a document index.

    manifest.json        counts, tokenizer, and a size + sha256 for every other file
    shard-00000.arrow    Arrow IPC file, one row per document: tokens list<uint16|uint32>,
                         end-of-text included; uncompressed so a read is one sequential copy
    index.parquet        one row per document: doc, shard, row, tokens, source (input number)
    tokenizer.json       the BPE trained here, or a copy of the pretrained tokenizer (absent for bytes)

Cheap checks (manifest sums, file sizes) run on open; checksums are verified on every shard read,
so a shard corrupted mid-run is caught before its tokens reach a model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megascale.data import DataError

FORMAT = "megascale-tokens/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    documents: int
    tokens: int
    first_doc: int
    bytes: int
    sha256: str


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Dataset:
    """Read side of a prepared directory; `bytes_read` counts what shard reads took from disk."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            hint = "" if self.root.is_dir() else " (directory missing)"
            raise DataError(f"{path}: no manifest{hint}; make one with `megascale data prepare`") from None
        try:
            m = json.loads(raw)
            self.format = m["format"]
            tok = m["tokenizer"]
            self.tokenizer_kind, self.vocab_size, self.eot_id = tok["kind"], int(tok["vocab_size"]), int(tok["eot_id"])
            self.dtype = np.dtype(m["dtype"])
            self.documents, self.tokens = int(m["documents"]), int(m["tokens"])
            self.shards = [ShardInfo(**s) for s in m["shards"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: corrupt manifest ({type(e).__name__}: {e})") from None
        if self.format != FORMAT:
            raise DataError(f"{path}: format {self.format!r}, this version reads {FORMAT!r}")
        self.manifest = m
        self.fingerprint = sha256_bytes(raw)[:16]  # names this exact dataset in checkpoints
        self.bytes_read = 0
        self._check_manifest(path)

    def _check_manifest(self, path: Path) -> None:
        if self.documents == 0 or self.tokens == 0 or not self.shards:
            raise DataError(f"{path}: the dataset is empty (0 documents)")
        if sum(s.tokens for s in self.shards) != self.tokens:
            raise DataError(f"{path}: manifest mismatch: shard tokens add up to "
                            f"{sum(s.tokens for s in self.shards)}, manifest says {self.tokens}")
        first = 0
        for s in self.shards:
            if s.first_doc != first:
                raise DataError(f"{path}: manifest mismatch: {s.file} starts at document {s.first_doc}, "
                                f"expected {first}")
            first += s.documents
        if first != self.documents:
            raise DataError(f"{path}: manifest mismatch: shard documents add up to {first}, "
                            f"manifest says {self.documents}")
        for s in self.shards:
            f = self.root / s.file
            if not f.is_file():
                raise DataError(f"{f}: shard missing (listed in {MANIFEST})")
            size = f.stat().st_size
            if size != s.bytes:
                raise DataError(f"{f}: corrupt shard: {size} bytes, manifest says {s.bytes}")

    @property
    def shard_tokens(self) -> np.ndarray:
        return np.array([s.tokens for s in self.shards], dtype=np.int64)

    def document_tokens(self) -> np.ndarray:
        """int64 [documents]: every document's length, from the index (no shard is read)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        entry = self.manifest.get("index") or {}
        if not entry.get("file"):
            raise DataError(f"{self.root / MANIFEST}: no document index (prepare the dataset again)")
        path = self.root / entry["file"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: missing (listed in {MANIFEST})") from None
        if sha256_bytes(data) != entry["sha256"]:
            raise DataError(f"{path}: checksum does not match {MANIFEST}")
        table = pq.read_table(pa.BufferReader(data), columns=["doc", "tokens"])
        order = np.argsort(table.column("doc").to_numpy())
        lengths = table.column("tokens").to_numpy().astype(np.int64)[order]
        if len(lengths) != self.documents or int(lengths.sum()) != self.tokens:
            raise DataError(f"{path}: manifest mismatch: the index lists {len(lengths)} documents / "
                            f"{int(lengths.sum())} tokens, the manifest {self.documents} / {self.tokens}")
        return lengths

    def read_shard(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, offsets): document d of the shard is tokens[offsets[d]:offsets[d+1]]."""
        import pyarrow as pa

        s = self.shards[i]
        path = self.root / s.file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: shard missing (listed in {MANIFEST})") from None
        self.bytes_read += len(data)
        if len(data) != s.bytes or sha256_bytes(data) != s.sha256:
            raise DataError(f"{path}: corrupt shard: checksum does not match {MANIFEST}")
        try:
            column = pa.ipc.open_file(pa.py_buffer(data)).read_all().column("tokens").combine_chunks()
        except (pa.ArrowException, KeyError) as e:
            raise DataError(f"{path}: corrupt shard: {e}") from None
        offsets = column.offsets.to_numpy().astype(np.int64)
        tokens = column.values.to_numpy()[offsets[0]:offsets[-1]]
        offsets -= offsets[0]
        if len(offsets) - 1 != s.documents or len(tokens) != s.tokens:
            raise DataError(f"{path}: manifest mismatch: shard holds {len(offsets) - 1} documents / "
                            f"{len(tokens)} tokens, manifest says {s.documents} / {s.tokens}")
        return tokens, offsets


def verify(root: str | Path) -> Dataset:
    """Opens a dataset and checks every file's checksum; raises DataError on the first problem."""
    ds = Dataset(root)
    for i in range(len(ds.shards)):
        ds.read_shard(i)
    for key in ("index", "tokenizer"):
        entry = ds.manifest.get(key) or {}
        if entry.get("file"):
            f = ds.root / entry["file"]
            if not f.is_file():
                raise DataError(f"{f}: missing (listed in {MANIFEST})")
            if sha256_file(f) != entry["sha256"]:
                raise DataError(f"{f}: checksum does not match {MANIFEST}")
    return ds
