"""The pieces without ranks: shard headers, manifests and retention, keeper messages."""
from __future__ import annotations

import os
import socket

import pytest

from megascale.checkpoint import ipc
from megascale.checkpoint.storage import (
    CorruptShard, apply_retention, decode_header, encode_header, list_steps, new_manifest, open_storage,
    read_manifest, step_dir, write_manifest,
)


def test_shard_header_round_trip_and_rejects_malformed_headers():
    header = encode_header([("master", "F32", [4], 0, 16), ("rng.torch", "U8", [3], 16, 19)], {"megascale": "{}"})
    assert len(header) % 8 == 0  # tensor data starts aligned
    image = memoryview(header + bytes(19))
    parsed, start = decode_header(image)
    assert start == len(header) and parsed["master"]["data_offsets"] == [0, 16]
    with pytest.raises(CorruptShard, match="exceeds the file"):
        decode_header(memoryview((10**9).to_bytes(8, "little") + b"{}"))
    with pytest.raises(CorruptShard, match="not valid JSON"):
        decode_header(memoryview((4).to_bytes(8, "little") + b"{{{{"))
    with pytest.raises(CorruptShard, match="outside"):
        decode_header(memoryview(header + bytes(10)))  # data shorter than the offsets say


def test_retention_keeps_the_newest_committed_and_drops_debris(tmp_path):
    storage = open_storage(str(tmp_path))
    layout = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
    for step in (1, 2, 3, 4, 5, 6):
        storage.fs.create_dir(storage.path(step_dir(step)))
        if step not in (3, 6):  # 3: a persist that failed; 6: one still in flight
            write_manifest(storage, step, new_manifest(step, layout, {}, {}))
    assert list_steps(storage) == {1: True, 2: True, 3: False, 4: True, 5: True, 6: False}
    assert apply_retention(storage, keep=2) == [1, 2, 3]
    assert list_steps(storage) == {4: True, 5: True, 6: False}
    assert read_manifest(storage, 5)["step"] == 5
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(tmp_path) for name in files)


def test_messages_larger_than_a_packet_and_file_descriptors_cross_the_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    big = {"op": "commit", "manifest": {"shards": {f"pp0-tp0-dp{i}": {"crc32": i} for i in range(5000)}}}
    ipc.send(a, big, (r,))
    got, fds = ipc.recv(b, timeout=5)
    assert got == big and len(fds) == 1
    os.write(w, b"x")
    assert os.read(fds[0], 1) == b"x"
    for fd in (r, w, *fds):
        os.close(fd)
    a.close()
    with pytest.raises(EOFError):
        ipc.recv(b, timeout=5)
