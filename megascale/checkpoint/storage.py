"""Checkpoint storage through pyarrow.fs: layout, shard file format, manifest, retention.

No torch here: the keeper process imports this module and must start fast.

    <uri>/step-00000100/pp0-tp0-dp0.safetensors   one shard per (pp, tp, dp) rank
    <uri>/step-00000100/...
    <uri>/step-00000100/manifest.json             written last: the commit point

A shard file is a safetensors file (8-byte little-endian header length, JSON header,
raw tensor bytes), so reading one never unpickles anything.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import pyarrow.fs as pafs

from megascale.config import RUN_DIR

FORMAT, VERSION = "megascale-checkpoint", 1
MANIFEST = "manifest.json"
CHUNK = 8 << 20  # I/O and checksum granularity
MAX_HEADER = 256 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or restored; the message names the problem."""


class StorageUnreadable(CheckpointError):
    """The checkpoint storage could not be listed from here (credentials, network, a volume not mounted)."""


class CorruptShard(CheckpointError):
    """A shard whose size or checksum differs from its manifest entry."""


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def shard_key(pp: int, tp: int, dp: int) -> str:
    return f"pp{pp}-tp{tp}-dp{dp}"


def shard_file(key: str) -> str:
    return f"{key}.safetensors"


# ---- file systems --------------------------------------------------------------------------


@dataclass
class Storage:
    fs: pafs.FileSystem
    root: str
    uri: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def object_store(self) -> bool:
        # S3/GCS: no atomic rename, but an object only appears once fully uploaded.
        return self.fs.type_name in ("s3", "gcs")


def load_factory(spec: str) -> Callable[[str], tuple[pafs.FileSystem, str]]:
    """`module:function` or `/path/to/file.py:function`."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise CheckpointError(f"checkpoint.filesystem={spec!r}: expected module:function or file.py:function")
    if target.endswith(".py"):
        loaded = importlib.util.spec_from_file_location(f"megascale_fs_{abs(hash(target))}", target)
        if loaded is None or loaded.loader is None:
            raise CheckpointError(f"checkpoint.filesystem={spec!r}: cannot load {target}")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


def normalize_uri(uri: str) -> str:
    """Local paths become absolute, so every process names the same place the same way."""
    return uri if "://" in uri else os.path.abspath(uri)


def open_storage(uri: str, factory: Optional[str] = None) -> Storage:
    """`file://`, `hdfs://`, `s3://` URIs or local paths; `factory(uri) -> (FileSystem, path)` overrides."""
    uri = normalize_uri(uri)
    if factory:
        fs, root = load_factory(factory)(uri)
    else:
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise CheckpointError(f"checkpoint.uri={uri}: {e}") from None
    return Storage(fs, root, uri)


# ---- shard files ---------------------------------------------------------------------------


def encode_header(tensors: list[tuple[str, str, list[int], int, int]], metadata: dict[str, str]) -> bytes:
    """safetensors header for `(name, dtype, shape, begin, end)` entries, length prefix included."""
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
              for name, dtype, shape, begin, end in tensors}
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def decode_header(image: memoryview) -> tuple[dict, int]:
    """(header, data start) of a safetensors image; CorruptShard on anything malformed."""
    if len(image) < 8:
        raise CorruptShard("shard shorter than its header length field")
    n = int.from_bytes(image[:8], "little")
    if n > min(MAX_HEADER, len(image) - 8):
        raise CorruptShard(f"shard header length {n} exceeds the file")
    try:
        header = json.loads(bytes(image[8:8 + n]))
    except ValueError:
        raise CorruptShard("shard header is not valid JSON") from None
    data = len(image) - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        size = DTYPE_BYTES.get(entry["dtype"], 0)
        count = 1
        for d in entry["shape"]:
            count *= d
        if not 0 <= begin <= end <= data or end - begin != count * size:
            raise CorruptShard(f"shard tensor {name} has offsets {begin}..{end} outside its {data} data bytes")
    return header, 8 + n


def checksum(chunks: Iterable[memoryview], crc: int = 0) -> int:
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers
    return crc


def chunks_of(view: memoryview) -> Iterable[memoryview]:
    for at in range(0, len(view), CHUNK):
        yield view[at:at + CHUNK]


def write_file(storage: Storage, path: str, image: memoryview) -> int:
    """Streams `image` to `path`; returns its crc32 (computed over the bytes as written)."""
    crc = 0
    with storage.fs.open_output_stream(path) as out:
        for chunk in chunks_of(image):
            crc = zlib.crc32(chunk, crc)
            out.write(chunk)
    return crc


def read_verified(storage: Storage, path: str, out: memoryview, crc: int) -> None:
    """Reads `path` into `out` (its expected size); CorruptShard on size or checksum mismatch."""
    size = len(out)
    try:
        found = storage.fs.get_file_info(path).size
    except OSError as e:
        raise CorruptShard(f"{path}: {e}") from None
    if found is None or found != size:
        raise CorruptShard(f"{path} is {found} bytes, the manifest says {size} (truncated or overwritten)")
    got, at = 0, 0
    with storage.fs.open_input_stream(path) as f:
        while at < size:
            n = f.readinto(out[at:at + CHUNK])
            if not n:
                break
            got = zlib.crc32(out[at:at + n], got)
            at += n
    if at != size:
        raise CorruptShard(f"{path}: read {at} of {size} bytes (truncated)")
    if got != crc:
        raise CorruptShard(f"{path}: checksum crc32 {got:08x} != manifest {crc:08x} (corrupted)")


# ---- manifests and retention ---------------------------------------------------------------


def write_manifest(storage: Storage, step: int, manifest: dict) -> None:
    """The commit point: a checkpoint exists once its manifest does, never partially."""
    path = storage.path(step_dir(step), MANIFEST)
    data = json.dumps(manifest, indent=1).encode()
    if storage.object_store:
        target = path  # an upload becomes visible only when complete
    else:
        target = path + ".tmp"
    with storage.fs.open_output_stream(target) as out:
        out.write(data)
    if target != path:
        storage.fs.move(target, path)


def read_manifest(storage: Storage, step: int) -> dict:
    path = storage.path(step_dir(step), MANIFEST)
    with storage.fs.open_input_stream(path) as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise CheckpointError(f"{path}: not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest for step {step}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: manifest version {manifest.get('version')}, this version reads {VERSION}")
    return manifest


def list_steps(storage: Storage) -> dict[int, bool]:
    """step -> committed, for every step directory under the root."""
    # A missing root is "no checkpoints"; any other listing error must not read as that.
    infos = storage.fs.get_file_info(pafs.FileSelector(storage.root, allow_not_found=True))
    steps = {}
    for info in infos:
        name = info.base_name
        if info.type == pafs.FileType.Directory and name.startswith("step-") and name[5:].isdigit():
            steps[int(name[5:])] = False
    if steps:
        paths = [storage.path(step_dir(s), MANIFEST) for s in steps]
        for step, info in zip(list(steps), storage.fs.get_file_info(paths)):
            steps[step] = info.type == pafs.FileType.File
    return dict(sorted(steps.items()))


def committed_steps(storage: Storage) -> list[int]:
    return [s for s, done in list_steps(storage).items() if done]


def check_fresh_start(uri: Optional[str], resume: bool, factory: Optional[str] = None) -> None:
    """A job that does not resume must not start on a checkpoint.uri holding another run's
    checkpoints: its restarts would restore those (CheckpointError, one line, naming the fix)."""
    if not uri or resume or RUN_DIR in uri:
        return
    try:
        steps = committed_steps(open_storage(uri, factory))
    except OSError as e:
        raise StorageUnreadable(f"checkpoint.uri={uri}: cannot list it: {e}") from None
    if steps:
        raise CheckpointError(
            f"checkpoint.uri={uri} already holds committed checkpoints (newest step {steps[-1]}) of an earlier run: "
            f"set checkpoint.resume: true to continue from them, or use a new checkpoint.uri "
            f"(\"{{run_dir}}/checkpoints\" gives every run its own)")


def apply_retention(storage: Storage, keep: int) -> list[int]:
    """Keeps the newest `keep` committed checkpoints; drops older ones and abandoned partial ones."""
    steps = list_steps(storage)
    committed = [s for s, done in steps.items() if done]
    if not committed:
        return []
    kept = set(committed[-keep:])
    newest = committed[-1]
    # Uncommitted directories newer than the newest commit may still be in flight: leave them.
    removed = [s for s in steps if s not in kept and s < newest]
    for step in removed:
        storage.fs.delete_dir(storage.path(step_dir(step)))
    return removed


def new_manifest(step: int, layout: dict, config: dict, shards: dict[str, dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "layout": layout,
            "world_size": layout["tp"] * layout["pp"] * layout["dp"], "checksum": "crc32", "shards": shards,
            "config": config}
