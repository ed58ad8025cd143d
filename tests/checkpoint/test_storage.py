"""The pieces without ranks: shard files, manifests and retention, keeper messages."""
from __future__ import annotations

import json
import os
import socket

import pytest

import safetensors.torch
import torch

from megascale.checkpoint import ipc
from megascale.checkpoint.shard_format import header_json, lay_out, pad_header, read_shard
from megascale.checkpoint.storage import (
    CheckpointError, CorruptShard, OtherFormat, apply_retention, check_checkpoint_uri, list_steps, new_manifest,
    open_storage, read_manifest, step_dir, write_manifest,
)


def memfd(data: bytes) -> int:
    fd = os.memfd_create("shard")
    os.write(fd, data)
    return fd


def test_shards_round_trip_through_the_safetensors_library_both_ways():
    tensors = {"optimizer.master": torch.randn(5), "rng.torch": torch.arange(3, dtype=torch.uint8),
               "x.bf16": torch.randn(2, 3).bfloat16()}
    meta = {"step": 7, "parts": {"train": {"step": 7}}}
    entries = lay_out(tensors)
    assert [e.name for e in entries] == ["optimizer.master", "x.bf16", "rng.torch"]  # widest first: aligned
    header = pad_header(header_json(entries, meta), 4096)
    assert len(header) == 4096 and pad_header(header_json(entries, meta), 64) is None
    image = header + b"".join(tensors[e.name].contiguous().view(torch.uint8).numpy().tobytes() for e in entries)
    loaded = safetensors.torch.load(image)  # the library reads what this writes ...
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    fd = memfd(image)
    got_meta, got = read_shard(fd)
    os.close(fd)
    assert got_meta == meta and all(torch.equal(got[k], t) for k, t in tensors.items())
    fd = memfd(safetensors.torch.save(tensors, {"megascale": json.dumps(meta)}))  # ... and this reads the library's
    got_meta, got = read_shard(fd)
    os.close(fd)
    assert got_meta == meta and all(torch.equal(got[k], t) for k, t in tensors.items())


@pytest.mark.parametrize("data, error", [
    (b"\0" * 64, "not a safetensors file"),
    ((10**9).to_bytes(8, "little") + b"{}", "not a safetensors file"),  # a header longer than the file
    (safetensors.torch.save({"a": torch.zeros(4)})[:-3], "not a safetensors file"),  # shorter than its offsets say
    (safetensors.torch.save({"a": torch.zeros(4)}), "no megascale metadata"),
    (safetensors.torch.save({"a": torch.zeros(4)}, {"megascale": "{{"}), "not valid JSON"),
])
def test_malformed_shards_are_refused_in_one_line(data, error):
    fd = memfd(data)
    with pytest.raises(CorruptShard, match=error) as raised:
        read_shard(fd)
    os.close(fd)
    assert "\n" not in str(raised.value)


def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(tmp_path):
    storage = open_storage(str(tmp_path))
    storage.fs.create_dir(storage.path(step_dir(4)))
    old = {**new_manifest(4, {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, {}, {}), "version": 1}
    write_manifest(storage, 4, old)
    with pytest.raises(OtherFormat, match=r"format version 1, written by another megascale version"):
        read_manifest(storage, 4)
    with pytest.raises(OtherFormat, match=r"step-00000004.*format version 1.*start anew with another checkpoint.uri"):
        check_checkpoint_uri(str(tmp_path), resume=True)


@pytest.mark.parametrize("uri", ["foo://bar", "s3://a b", "hdfs://127.0.0.1:1/ckpt"])
def test_an_unusable_uri_is_refused_in_one_line_naming_the_field_it_came_from(uri):
    # pyarrow's HDFS loader without a JVM lists every path it tried, one per line
    for field in ("checkpoint.uri", "OUT_CHECKPOINT"):
        with pytest.raises(CheckpointError) as refused:
            check_checkpoint_uri(uri, resume=False, field=field)
        assert str(refused.value).startswith(f"{field}={uri}: ") and "\n" not in str(refused.value)


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
