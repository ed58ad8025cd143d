"""Predictable file names (a node's keeper log) live in this user's own 0700 directory under the temp
directory, never straight in a shared /tmp where another local user could have made the name first."""
from __future__ import annotations

import os
import stat
import tempfile

import pytest

from megascale.checkpoint.client import _log_path
from megascale.checkpoint.storage import CheckpointError
from megascale.common.private_dir import ForeignDirectory, private_temp_dir


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_directory_is_made_for_this_user_alone_and_found_again(temp_dir):
    path = private_temp_dir()
    assert path == temp_dir / f"megascale-{os.getuid()}" and stat.S_IMODE(path.stat().st_mode) == 0o700
    assert private_temp_dir() == path
    assert _log_path("/ckpt").parent == path and _log_path("/ckpt").name.startswith("keeper-")


@pytest.mark.parametrize("squat", ["symlink", "open to others", "another user's"])
def test_a_name_someone_else_made_first_is_refused_in_one_line(temp_dir, squat):
    path, victim = temp_dir / f"megascale-{os.getuid()}", temp_dir / "victim"
    victim.mkdir(mode=0o700)
    if squat == "symlink":  # a keeper would have appended its log to a file of the attacker's choosing
        path.symlink_to(victim)
    else:
        path.mkdir(mode=0o777 if squat == "open to others" else 0o700)
        path.chmod(0o777 if squat == "open to others" else 0o700)
        if squat == "another user's":
            if os.geteuid() != 0:
                pytest.skip("making a directory another user's needs root")
            os.chown(path, 65534, 65534)
    with pytest.raises(ForeignDirectory, match=rf"^{path} is not this user's private directory"):
        private_temp_dir()
    with pytest.raises(CheckpointError, match="^the checkpoint keeper's log: .* set TMPDIR"):
        _log_path("/ckpt")
    assert list(victim.iterdir()) == []
