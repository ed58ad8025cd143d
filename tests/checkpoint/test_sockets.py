"""The keeper's abstract Unix socket has no file permissions: a rank refuses a keeper socket another
user bound first (a squatted name), before it sends its snapshot buffer, and starts no keeper."""
from __future__ import annotations

import os
import socket

import pytest

from megascale.checkpoint import ipc
from megascale.checkpoint.client import KeeperLink
from megascale.checkpoint.storage import CheckpointError


def test_a_keeper_socket_squatted_by_another_user_is_refused(tmp_path, monkeypatch):
    uri = str(tmp_path / "ckpt")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    squatter.bind(ipc.socket_name(uri))
    squatter.listen()
    monkeypatch.setattr(ipc, "peer_uid", lambda sock: os.getuid() + 1)  # the squatter runs as another user
    with pytest.raises(CheckpointError) as e:
        KeeperLink(uri, rank=0)
    assert str(e.value).startswith(f"the checkpoint keeper socket for {uri} is held by uid {os.getuid() + 1}, not "
                                   f"by this user") and "\n" not in str(e.value)
    conn, _ = squatter.accept()
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 4096, 4)
    assert data == b"" and fds == []  # hung up without a word: no hello, no buffer
    conn.close()
    squatter.close()
