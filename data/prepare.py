"""`megascale data prepare`: local text -> token shards + index + manifest (format in dataset.py).

Deterministic: inputs are read in a fixed order (directories sorted), BPE training is
deterministic, and nothing time- or host-dependent is written, so the same input gives
byte-identical shards and manifest.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from megascale.data import DataError
from megascale.data.dataset import FORMAT, MANIFEST, Dataset, sha256_bytes, sha256_file
from megascale.data.tokenizer import HF_FILE, NAMES, load_pretrained, make_tokenizer

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".jsonl")  # what a directory input contributes
DEFAULT_SHARD_TOKENS = 1 << 22  # 8 MiB of uint16 per shard: big sequential reads, small windows
ENCODE_BATCH = 256


def list_inputs(inputs: list[str | Path]) -> list[Path]:
    """Files named directly, plus text files under directories, in a fixed order."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
                 and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            files.extend(found)
        else:
            raise DataError(f"{p}: input not found")
    unique, seen = [], set()
    for f in files:  # a file named twice (directly and via its folder) is one input
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    if not unique:
        raise DataError(f"empty corpus: no text files ({', '.join(TEXT_SUFFIXES)}) in {', '.join(map(str, inputs))}")
    return unique


def iter_documents(files: list[Path]) -> Iterator[tuple[int, str]]:
    """(input number, text): a .jsonl line's "text" field, or a whole other file; blank ones skipped."""
    for i, path in enumerate(files):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
        if path.suffix != ".jsonl":
            if text.strip():
                yield i, text
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)["text"]
                if not isinstance(doc, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise DataError(f'{path}:{lineno}: not a JSON object with a "text" string') from None
            if doc.strip():
                yield i, doc


class _ShardWriter:
    def __init__(self, root: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.dtype, self.shard_tokens = root, dtype, shard_tokens
        self.shards: list[dict] = []
        self.docs: list[np.ndarray] = []
        self.pending = 0
        self.documents = 0

    def add(self, tokens: np.ndarray) -> tuple[int, int]:
        """Appends one document; returns its (shard, row)."""
        where = (len(self.shards), len(self.docs))
        self.docs.append(tokens)
        self.pending += len(tokens)
        if self.pending >= self.shard_tokens:
            self.flush()
        return where

    def flush(self) -> None:
        import pyarrow as pa

        if not self.docs:
            return
        offsets = np.zeros(len(self.docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in self.docs], out=offsets[1:])
        values = pa.array(np.concatenate(self.docs).astype(self.dtype))
        table = pa.table({"tokens": pa.LargeListArray.from_arrays(pa.array(offsets), values)})
        name = f"shard-{len(self.shards):05d}.arrow"
        with pa.OSFile(str(self.root / name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        self.shards.append({
            "file": name, "documents": len(self.docs), "tokens": int(offsets[-1]), "first_doc": self.documents,
            "bytes": (self.root / name).stat().st_size, "sha256": sha256_file(self.root / name),
        })
        self.documents += len(self.docs)
        self.docs, self.pending = [], 0


def prepare(
    inputs: list[str | Path],
    output: str | Path,
    *,
    tokenizer: str = "byte",
    vocab: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
) -> dict:
    """Tokenizes `inputs` into the dataset directory `output`; returns the manifest.

    `tokenizer`: byte, bpe (trained on the inputs to `vocab` ids) or a path to a pretrained one
    (see tokenizer.load_pretrained), which is copied into `output` as tokenizer.json.
    """
    output = Path(output)
    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens {shard_tokens}: must be > 0")
    if output.exists() and not force:
        raise DataError(f"{output}: already exists (pass --force to replace it)")
    files = list_inputs(inputs)
    texts = (text for _, text in iter_documents(files))
    tok = make_tokenizer(tokenizer, texts if tokenizer == "bpe" else None, vocab)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)

    # Build beside the target and rename at the end: a crash never leaves a half dataset behind.
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _write(files, tok, dtype, tmp, shard_tokens)
        if output.exists():
            shutil.rmtree(output)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write(files: list[Path], tok, dtype: np.dtype, root: Path, shard_tokens: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = _ShardWriter(root, dtype, shard_tokens)
    index: dict[str, list[int]] = {"doc": [], "shard": [], "row": [], "tokens": [], "source": []}
    batch: list[tuple[int, str]] = []

    def encode(batch: list[tuple[int, str]]) -> None:
        for (source, _), doc in zip(batch, tok.encode_documents([t for _, t in batch])):
            shard, row = writer.add(doc)
            for key, value in zip(index, (len(index["doc"]), shard, row, len(doc), source)):
                index[key].append(value)

    for item in iter_documents(files):
        batch.append(item)
        if len(batch) == ENCODE_BATCH:
            encode(batch)
            batch = []
    encode(batch)
    writer.flush()
    if not index["doc"]:
        raise DataError(f"empty corpus: the {len(files)} input file(s) hold no non-blank document")

    pq.write_table(pa.table({k: pa.array(v, pa.int64()) for k, v in index.items()}), root / "index.parquet")
    tok_entry = {"kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "file": None, "sha256": None}
    if tok.kind != "byte":
        # The tokenizer travels with its tokens: sampling and export read it from here.
        (root / HF_FILE).write_bytes(tok.file_bytes)
        tok_entry.update(file=HF_FILE, sha256=sha256_file(root / HF_FILE), **tok.manifest_entry())
    manifest = {
        "format": FORMAT,
        "tokenizer": tok_entry,
        "dtype": dtype.name,
        "documents": len(index["doc"]),
        "tokens": int(sum(index["tokens"])),
        "shard_tokens": shard_tokens,
        "shards": writer.shards,
        "index": {"file": "index.parquet", "sha256": sha256_file(root / "index.parquet")},
        "inputs": [{"path": str(f), "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files],
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    Dataset(root)  # the reader's own checks, so a bad write fails here rather than in a job
    return manifest


def prepare_cached(path: str | Path, run_dir: str | Path, *, tokenizer: str = "byte", vocab: int | None = None,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Path:
    """data.source=text: prepares `path` once into run_dir/data/, keyed by inputs and tokenizer.

    Every rank may call this at once; a file lock lets one prepare while the others wait, and a
    changed input (size or mtime) gets a new directory instead of stale tokens.
    """
    import fcntl
    import hashlib

    files = list_inputs([path])
    tok_key = tokenizer
    if tokenizer not in NAMES:  # keyed by content: an edited tokenizer gets new tokens
        tok = load_pretrained(tokenizer)
        tok_key = [sha256_bytes(tok.file_bytes), tok.eot_token, tok.eot_first]
    key = json.dumps({
        "format": FORMAT, "tokenizer": tok_key, "vocab": vocab, "shard_tokens": shard_tokens,
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    })
    name = "text-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(run_dir) / "data"
    out = cache / name
    if (out / MANIFEST).is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / MANIFEST).is_file():
            prepare(files, out, tokenizer=tokenizer, vocab=vocab, shard_tokens=shard_tokens, force=True)
    return out
