"""Checkpoint storage through pyarrow.fs: layout, checksummed shard I/O, manifest, retention.

No torch here: the keeper process imports this module and must start fast.

    <uri>/step-00000100/pp0-tp0-dp0.safetensors   one shard per (pp, tp, dp) rank (shard_format.py)
    <uri>/step-00000100/...
    <uri>/step-00000100/manifest.json             written last: the commit point
"""
from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import pyarrow.fs as pafs

from megascale.checkpoint.filesystems import UnknownFilesystem, open_filesystem
from megascale.common.errors import first_line
from megascale.config import RUN_DIR

log = logging.getLogger("megascale.checkpoint")

# Version 2: shards hold the state dicts of named parts (version 1: a fixed set of ZeRO tensors).
FORMAT, VERSION = "megascale-checkpoint", 2
MANIFEST = "manifest.json"
CHUNK = 8 << 20  # I/O and checksum granularity


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or restored; the message names the problem."""


class StorageUnreadable(CheckpointError):
    """The checkpoint storage could not be listed from here (credentials, network, a volume not mounted)."""


class CorruptShard(CheckpointError):
    """A shard whose size or checksum differs from its manifest entry, or whose contents are malformed."""


class OtherFormat(CheckpointError):
    """A checkpoint written in a format version this version does not read."""


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
    local: bool = False  # the root is on this machine's disks: what is written can be fsynced

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def sync(self, path: str, directory: bool = False) -> None:
        """Makes `path`'s contents (a directory: its entries) durable before anything depends on them.

        pyarrow has no fsync, so this reaches local disks only. Elsewhere what holds is the store's own
        guarantee: S3 and GCS acknowledge an upload (closing its stream) once it is stored redundantly,
        and an object appears only whole; HDFS has a closed file on `replication` datanodes (in their
        memory, not necessarily on disk) and its namenode journals the rename: a lost machine loses
        nothing, a power loss of the whole cluster may lose the newest checkpoint, never the older ones
        retention keeps until the newest is committed."""
        if not self.local:
            return
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @property
    def object_store(self) -> bool:
        # S3/GCS: no atomic rename, but an object only appears once fully uploaded.
        return self.fs.type_name in ("s3", "gcs")


def normalize_uri(uri: str) -> str:
    """Local paths become absolute, so every process names the same place the same way."""
    return uri if "://" in uri else os.path.abspath(uri)


def open_storage(uri: str, filesystem: Optional[str] = None, options: Optional[Mapping[str, str]] = None,
                 field: str = "checkpoint.uri") -> Storage:
    """`file://`, `hdfs://`, `s3://` URIs or local paths; `filesystem` (checkpoint.filesystem), a registered
    file system by name with its `options` (filesystems.py), overrides the one the URI implies. `field` names
    the uri in the error for one that cannot be parsed."""
    uri = normalize_uri(uri)
    if filesystem or options:
        try:
            fs, root = open_filesystem(filesystem, options or {}, uri)
        except UnknownFilesystem as e:
            raise CheckpointError(str(e)) from None
    else:
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise CheckpointError(f"{field}={uri}: {first_line(e)}") from None
    return Storage(fs, root, uri, local=isinstance(fs, pafs.LocalFileSystem))


# ---- shard I/O ----------------------------------------------------------------------------


def checksum(chunks: Iterable[memoryview], crc: int = 0) -> int:
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers
    return crc


def chunks_of(view: memoryview) -> Iterable[memoryview]:
    for at in range(0, len(view), CHUNK):
        yield view[at:at + CHUNK]


def write_file(storage: Storage, path: str, image: memoryview) -> int:
    """Streams `image` to `path` and makes it durable; returns its crc32 (over the bytes as written)."""
    crc = 0
    with storage.fs.open_output_stream(path) as out:
        for chunk in chunks_of(image):
            crc = zlib.crc32(chunk, crc)
            out.write(chunk)
    storage.sync(path)
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
    """The commit point: a checkpoint exists once its manifest does, never partially. On return it is
    durable (`Storage.sync`): only then may retention delete older checkpoints."""
    directory = storage.path(step_dir(step))
    path = f"{directory}/{MANIFEST}"
    data = json.dumps(manifest, indent=1).encode()
    if storage.object_store:
        target = path  # an upload becomes visible only when complete
    else:
        target = path + ".tmp"
    with storage.fs.open_output_stream(target) as out:
        out.write(data)
    if target == path:
        return
    # The shards' contents were synced as each was written; now the manifest's, the names in the step
    # directory and the step directory's name in the root, so the rename never commits what a power
    # loss could take back; then the rename itself.
    storage.sync(target)
    storage.sync(directory, directory=True)
    storage.sync(storage.root, directory=True)
    storage.fs.move(target, path)
    storage.sync(directory, directory=True)


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
        raise OtherFormat(f"{path}: a checkpoint in format version {manifest.get('version')}, written by another "
                          f"megascale version (this one reads version {VERSION})")
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


# The model fields that decide the parameters' names and full shapes; what a field meant before it
# existed (a checkpoint written by an earlier version) is its default. Everything else, parallelism
# included, may change on resume (config.validate refuses a tp or pp*vpp that does not fit the model).
MODEL_FIELDS = {"arch": "gpt", "layers": None, "hidden": None, "heads": None, "kv_heads": None, "ffn": None,
                "vocab": None, "block": "serial", "tied_embeddings": False}


def _model_field(model: dict, name: str):
    value = model.get(name, MODEL_FIELDS[name])
    return model.get("heads") if name == "kv_heads" and value is None else value  # None: as many as heads


def check_compatible(manifest: dict, model: dict, parts: Sequence[str] = ()) -> None:
    """CheckpointError (one line naming the field) if a job with `model` cannot restore `manifest`'s
    checkpoint, or it holds no state for one of `parts`."""
    saved, step = manifest["config"]["model"], manifest["step"]
    for name in MODEL_FIELDS:
        if _model_field(saved, name) != _model_field(model, name):
            raise CheckpointError(f"checkpoint step {step} has model.{name}={_model_field(saved, name)!r}, this job "
                                  f"has model.{name}={_model_field(model, name)!r}: a checkpoint restores onto any "
                                  "parallelism, not onto another model")
    missing = sorted(set(parts) - set(manifest["parts"]))
    if missing:
        raise CheckpointError(f"checkpoint step {step} holds no state for {missing[0]!r} "
                              f"(it holds {', '.join(manifest['parts'])})")


def check_checkpoint_uri(uri: Optional[str], resume: bool, filesystem: Optional[str] = None,
                         options: Optional[Mapping[str, str]] = None,
                         model: Optional[dict] = None, field: str = "checkpoint.uri",
                         when_held: Optional[str] = None) -> Optional[list[int]]:
    """Before a job starts (CheckpointError, one line, naming the fix): a fresh job's checkpoint.uri must
    not hold another run's checkpoints (its restarts would restore those), and a resumed job's newest
    checkpoint must be in a format this version reads and, given the job's `model` section, of that
    model. Storage that cannot be listed from here is StorageUnreadable for a fresh job, and left to
    the ranks for a resumed one. Returns the committed steps, or None where none were listed. `field`
    names the uri in those lines, and `when_held` replaces the advice for a fresh uri that holds some."""
    if uri and RUN_DIR in uri and resume:
        raise CheckpointError(
            f"checkpoint.uri={uri} gives every run checkpoints of its own, so checkpoint.resume finds none in a "
            f"new run: continue a run with `megascale train RUN_DIR --resume`, or set a fixed checkpoint.uri")
    if not uri or RUN_DIR in uri:
        return None
    try:
        storage = open_storage(uri, filesystem, options, field)
        steps = committed_steps(storage)
    except OSError as e:
        if resume:
            return None
        raise StorageUnreadable(f"{field}={uri}: cannot list it: {first_line(e)}") from None
    if resume:
        manifest = None
        try:
            if steps:
                manifest = read_manifest(storage, steps[-1])
        except OtherFormat as e:
            raise OtherFormat(f"{e}: resume it with that version, or start anew with another checkpoint.uri") \
                from None
        except (CheckpointError, OSError):  # a damaged newest checkpoint: the ranks fall back to an older one
            pass
        if manifest is not None and model is not None:
            check_compatible(manifest, model)
        return steps
    if steps:
        advice = when_held or ("set checkpoint.resume: true to continue from them, or use a new checkpoint.uri "
                               "(\"{run_dir}/checkpoints\" gives every run its own)")
        raise CheckpointError(f"{field}={uri} already holds committed checkpoints (newest step {steps[-1]}) of an "
                              f"earlier run: {advice}")
    return steps


def apply_retention(storage: Storage, keep: int) -> list[int]:
    """Keeps the newest `keep` committed checkpoints; drops older ones and abandoned partial ones. Call
    it only once the newest is durable (`write_manifest` returned), or keep=1 may leave none."""
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


def new_manifest(step: int, layout: dict, config: dict, shards: dict[str, dict], parts: Sequence[str] = (),
                 tensors: Optional[dict] = None) -> dict:
    """`parts`: the names of the parts every shard holds the state of; `tensors`: each ShardedFlat's
    parameters (full shape, TP split and the pipeline ranks holding it), so a restore can plan which
    shards it needs before reading any."""
    return {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "layout": layout,
            "world_size": layout["tp"] * layout["pp"] * layout["dp"], "checksum": "crc32", "shards": shards,
            "parts": list(parts), "tensors": tensors or {}, "config": config}


def committed_or_why(storage: Storage, uri: str) -> list[int] | str:
    """Committed steps, newest first; or why they cannot be listed (every rank raises it)."""
    try:
        return sorted(committed_steps(storage), reverse=True)
    except (CheckpointError, OSError) as e:
        return f"cannot list the checkpoints under {uri}: {e}"


def manifest_or_why(storage: Storage, step: int) -> dict | str | None:
    """The manifest; why this version cannot read it (another format); None if it is damaged."""
    try:
        return read_manifest(storage, step)
    except OtherFormat as e:
        return str(e)
    except (CheckpointError, OSError) as e:
        log.error("checkpoint step %d: unreadable manifest: %s", step, e)
        return None
