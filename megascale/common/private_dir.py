"""This user's own directory under the temp directory, for files whose names must be predictable (a node's
checkpoint keeper log, found by any rank of the node): a fixed name straight in a shared /tmp is one another
local user can create first, as a symlink to a file of this user's (with fs.protected_symlinks=0 the keeper
would append to it) or as a file of theirs. The directory is made 0700 and, when it exists, believed only if
it is a real directory of this user's that no one else may enter."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


class ForeignDirectory(PermissionError):
    """One line for the user: the directory is not this user's private one."""


def private_temp_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"megascale-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ForeignDirectory(f"{path} is not this user's private directory (a symlink, another user's, or open "
                               f"to others): remove it, or set TMPDIR to a directory of your own")
    return path
