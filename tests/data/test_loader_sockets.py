"""The node loader's socket is an abstract Unix socket, which has no file permissions: a rank refuses a
loader run by another user (a squatted name), and malformed lines never take the loader down."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
from megascale.data import DataError, make_batch_source
from megascale.data.node import socket_name

from megascale.checkpoint import ipc


def rank(dataset, run_dir, r: int):
    cfg = SimpleNamespace(source="shards", path=str(dataset), seed=7)
    return make_batch_source(cfg, seq=16, micro=1, microbatches=1, dp_rank=0, dp_size=1, tp_rank=r, tp_size=2,
                             pp_rank=0, pp_size=1, global_rank=r, run_dir=run_dir)


def test_junk_lines_leave_the_loader_serving_the_ranks(dataset, tmp_path):
    with rank(dataset, tmp_path, 0) as first:
        junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        junk.connect("\0" + first.cfg.socket)
        junk.settimeout(30)
        junk.sendall(b"\xff\xfe\nH\nH x y\nS 1\nC a b\nZ\n" + b"x" * 100 + b"\n")
        answers, more = b"", b"?"
        while answers.count(b"\n") < 5 and more:  # one "E malformed message" per line that does not parse
            more = junk.recv(4096)
            answers += more
        assert answers.startswith(b"E malformed message b'\\xff\\xfe'\n")
        with rank(dataset, tmp_path, 1) as second:  # the loader still accepts and serves the node's ranks
            a, b = first.next_sample(), second.next_sample()
            assert torch.equal(a.input_ids, b.input_ids)
        junk.close()


def test_a_loader_socket_squatted_by_another_user_is_refused(dataset, tmp_path, monkeypatch):
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0" + socket_name(str(tmp_path), 0))
    squatter.listen()
    monkeypatch.setattr(ipc, "peer_uid", lambda sock: os.getuid() + 1)  # the squatter runs as another user
    with pytest.raises(DataError) as e:
        rank(dataset, tmp_path, 0)
    assert "data loader's socket is held by uid" in str(e.value) and "\n" not in str(e.value)
    conn, _ = squatter.accept()
    conn.settimeout(10)
    assert conn.recv(4096) == b""  # the rank hung up without a word (no hello)
    conn.close()
    squatter.close()
