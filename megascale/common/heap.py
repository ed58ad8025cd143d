"""Giving freed host memory back to the system."""
from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Returns freed heap memory to the system: glibc keeps it in its arenas for reuse, and in-process
    incarnations reuse little of it. A 2-rank job of a 3.4M-parameter model grew each rank from 279 to
    526 MB over 6 incarnations without this, from 179 to 229 MB over 14 with it. Not glibc: nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
