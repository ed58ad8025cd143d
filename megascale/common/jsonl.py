"""Per-step JSON-lines files that stay bounded however long a run lasts: `RollingWriter` rolls a file over at a
size, keeping one earlier part (`<stem>.1.jsonl`), and `LineFollower` reads such files as they grow, following a
rollover without losing or repeating a line. A rank's timings and progress files take one line per step: about
0.3-0.5 KB, so 1-2 MB an hour per rank at a step a second, unbounded over weeks before.

Written here rather than with logging.handlers.RotatingFileHandler: the readers tail these files line by line
while they grow, and must carry on across the rollover from where they were in the part that was renamed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Optional


def rolled(path: Path) -> Path:
    """The earlier part of `path`: timings-rank0.jsonl -> timings-rank0.1.jsonl."""
    return path.with_name(f"{path.stem}.1{path.suffix}")


class RollingWriter:
    """Appends lines, flushed at once; past `max_bytes` (None: never) the file becomes its earlier part (the one
    before is dropped) and a new file starts."""

    def __init__(self, path: str | Path, max_bytes: Optional[int]):
        self.path, self.max_bytes = Path(path), max_bytes
        self._f: IO[str] = open(self.path, "a")

    def write(self, line: str) -> None:
        self._f.write(line + "\n")
        self._f.flush()
        if self.max_bytes is not None and self._f.tell() >= self.max_bytes:
            self._f.close()
            os.replace(self.path, rolled(self.path))
            self._f = open(self.path, "a")

    def close(self) -> None:
        self._f.close()


class LineFollower:
    """The new whole lines of growing files (a half-written last line waits for the next read). A file is first
    read from the start of its earlier part (all of it still on disk); after a rollover, the rest of the part
    that was being read comes first. Two rollovers between reads lose the lines of the part in between."""

    def __init__(self) -> None:
        self._at: dict[Path, tuple[int, int]] = {}  # path -> (inode, offset) of the part being read

    def skip_to_end(self, path: Path) -> None:
        """From now on only lines written after this call (the earlier part included)."""
        try:
            st = os.stat(path)
            self._at[path] = (st.st_ino, st.st_size)
        except FileNotFoundError:
            self._at[path] = (-1, 0)  # any file that appears is new

    def read(self, path: Path) -> list[bytes]:
        at = self._at.get(path)
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # not yet written, or between a rename and the new file
            if at is None:
                return []
            lines, self._at[path] = _rest(rolled(path), at)
            return lines
        with f:
            inode = os.fstat(f.fileno()).st_ino
            earlier: list[bytes] = []
            if at is None:
                earlier, read = _rest(rolled(path), None)
                if read is not None and read[0] == inode:  # it rolled over since the open: that part is this file
                    earlier = []
                at = (inode, 0)
            elif at[0] != inode:
                earlier, _ = _rest(rolled(path), at)
                at = (inode, 0)
            f.seek(at[1])
            lines, end = _whole_lines(f.read())
        self._at[path] = (inode, at[1] + end)
        return earlier + lines


def _rest(path: Path, at: Optional[tuple[int, int]]) -> tuple[list[bytes], Optional[tuple[int, int]]]:
    """The whole lines of `path` past `at`'s offset if it is `at`'s file (all of it for `at` None), and where
    that leaves the reader; nothing if it is another file."""
    try:
        with open(path, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            if at is not None and inode != at[0]:
                return [], at
            offset = at[1] if at is not None else 0
            f.seek(offset)
            lines, end = _whole_lines(f.read())
    except FileNotFoundError:
        return [], at
    return lines, (inode, offset + end)


def _whole_lines(chunk: bytes) -> tuple[list[bytes], int]:
    """The whole lines of `chunk` and the bytes they take (a half-written last line waits for the next read)."""
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].splitlines(), end
