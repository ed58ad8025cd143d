"""A shard file is a safetensors file: a rank's tensors as raw bytes, the rest of its state as JSON in
the header's metadata, so reading one never unpickles anything.

    [8-byte header length][JSON header, space-padded to the header room][tensor bytes]

The header room is fixed for the life of a job, so every tensor sits at the same place in every
snapshot: a snapshot copies tensors straight into the finished file image, and a host buffer holds
exactly one image, which the safetensors library can open as the file it is.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from megascale.checkpoint.storage import CorruptShard

PAGE = 4096
META_KEY = "megascale"  # the header metadata entry holding this format's JSON
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
ITEM_SIZES = {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard: its bytes are data[begin:end]."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def lay_out(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    """Back to back, widest element first, so each tensor is aligned (the data starts page-aligned)."""
    entries, at = [], 0
    for name, t in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        if t.dtype not in DTYPE_CODES:
            raise TypeError(f"checkpoint tensor {name} has dtype {t.dtype}, which safetensors does not store")
        nbytes = t.numel() * t.element_size()
        entries.append(Entry(name, t.dtype, tuple(t.shape), at, at + nbytes))
        at += nbytes
    return entries


def header_json(entries: list[Entry], meta: dict) -> bytes:
    """The safetensors header of a shard: each tensor's dtype, shape and place, and `meta` as JSON.

    Hand-written because the safetensors library serialises only whole files from the tensors' bytes:
    a second copy of the shard on the training critical path (0.8 s per 256 MiB here, six times the
    snapshot copy itself). This writes the same header in front of bytes already in place; reading,
    where malformed input matters, is the library's (`read_shard`)."""
    header = {"__metadata__": {META_KEY: json.dumps(meta, separators=(",", ":"))},
              **{e.name: {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
                 for e in entries}}
    return json.dumps(header, separators=(",", ":")).encode()


def pad_header(raw: bytes, room: int) -> Optional[bytes]:
    """Length prefix and `raw` padded so tensor bytes start at `room`; None if it does not fit."""
    if 8 + len(raw) > room:
        return None
    return (room - 8).to_bytes(8, "little") + raw.ljust(room - 8)  # JSON allows the trailing spaces


def header_room(raw: bytes) -> int:
    """Room for headers up to twice this one's size, whole pages: rarely outgrown, so rarely re-laid-out."""
    return -(-(2 * (8 + len(raw)) + PAGE) // PAGE) * PAGE


def read_shard(fd: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(this format's metadata, tensors) of the shard image that fills file descriptor `fd` (a memfd);
    the tensors map the file, nothing is copied. CorruptShard if it is no such shard."""
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            text = (f.metadata() or {}).get(META_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise CorruptShard(f"not a safetensors file: {e}") from None
    if text is None:
        raise CorruptShard(f"no {META_KEY} metadata in the shard header")
    try:
        return json.loads(text), tensors
    except ValueError:
        raise CorruptShard(f"the shard's {META_KEY} metadata is not valid JSON") from None


def tensor_places(image: memoryview) -> tuple[dict, int, dict[str, tuple[int, int, int]]]:
    """(this format's metadata, where tensor bytes start, {tensor: (first byte, end byte, element
    size)}) of a shard image, from its header alone. CorruptShard if it has no such header."""
    try:
        length = int.from_bytes(image[:8], "little")
        header = json.loads(bytes(image[8:8 + length]))
        meta = json.loads(header.pop("__metadata__")[META_KEY])
        data = 8 + length
        places = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            size = ITEM_SIZES[entry["dtype"]]
            if end - begin != math.prod(entry["shape"]) * size:
                raise ValueError(name)
            places[name] = (data + begin, data + end, size)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CorruptShard("malformed shard header") from None
    return meta, data, places
