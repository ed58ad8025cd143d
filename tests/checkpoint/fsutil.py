"""Test file systems for `checkpoint.filesystem`: a local file system that logs every byte read,
and can run out of space or write slowly, installed as the plugin `instrumented` (`register`: an
entry point as a cluster admin's package would add). Options live beside the checkpoint root in
`<root>.fs.json` ({"full": true} or {"limit": bytes written}, {"delay_s": seconds per write};
re-read on every write), the read log in `<root>.reads` ("path bytes" per closed input file), so
the keeper process and the ranks, each with its own copy of the plugin, share them."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

SPEC = "instrumented"  # checkpoint.filesystem, once registered
MODULE = "megascale_test_fsutil"


def register(directory: Path) -> Path:
    """Installs this file as the plugin SPEC under `directory` (a module and its dist-info, as pip would
    lay them out); it is found where `directory` is on sys.path (PYTHONPATH for child processes)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MODULE}.py").write_text(Path(__file__).read_text())
    info = directory / f"{MODULE}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[megascale.filesystems]\n{SPEC} = {MODULE}:instrumented\n")
    return directory


def instrumented(uri: str, options: dict[str, str]) -> tuple[pafs.FileSystem, str]:
    root = uri.removeprefix("file://")
    return pafs.PyFileSystem(Handler(root)), root


def reads(root: Path) -> list[tuple[str, int]]:
    """(file name, bytes) of every input file read under `root`, in order."""
    path = Path(f"{root}.reads")
    if not path.exists():
        return []
    return [(Path(p).name, int(n)) for p, n in (line.rsplit(" ", 1) for line in path.read_text().splitlines())]


def set_options(root: Path, **options) -> None:
    Path(f"{root}.fs.json").write_text(json.dumps(options))


class _Reader:
    def __init__(self, inner: pa.NativeFile, path: str, log: str):
        self.inner, self.path, self.log, self.count = inner, path, log, 0

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read() if n is None or n < 0 else self.inner.read(n)
        self.count += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.inner.seek(pos, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def size(self) -> int:
        return self.inner.size()

    def close(self) -> None:
        if not self.inner.closed:
            self.inner.close()
            with open(self.log, "a") as f:  # one short O_APPEND write: safe across processes
                f.write(f"{self.path} {self.count}\n")

    @property
    def closed(self) -> bool:
        return self.inner.closed


class _Writer:
    def __init__(self, inner: pa.NativeFile, handler: "Handler"):
        self.inner, self.handler = inner, handler

    def write(self, data) -> int:
        options = self.handler.options()
        if options.get("delay_s"):
            import time

            time.sleep(options["delay_s"])
        n = len(memoryview(data).cast("B"))
        if options.get("full") or ("limit" in options and self.handler.written + n > options["limit"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.handler.written += n
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


class Handler(pafs.FileSystemHandler):
    def __init__(self, root: str):
        self.root, self.local, self.written = root, pafs.LocalFileSystem(), 0

    def options(self) -> dict:
        path = Path(f"{self.root}.fs.json")
        return json.loads(path.read_text()) if path.exists() else {}

    def get_type_name(self):
        return "instrumented"

    def normalize_path(self, path):
        return path

    def equals(self, other):
        return isinstance(other, Handler) and other.root == self.root

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root")

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def open_input_stream(self, path):
        return pa.PythonFile(_Reader(self.local.open_input_stream(path), path, f"{self.root}.reads"), mode="r")

    def open_input_file(self, path):
        return pa.PythonFile(_Reader(self.local.open_input_file(path), path, f"{self.root}.reads"), mode="r")

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_Writer(self.local.open_output_stream(path), self), mode="w")

    def open_append_stream(self, path, metadata):
        return pa.PythonFile(_Writer(self.local.open_append_stream(path), self), mode="w")
