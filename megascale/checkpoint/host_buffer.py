"""The memfd host buffer a rank and its keeper share (client.py finds the keeper; this holds the bytes)."""
from __future__ import annotations

import logging
import mmap
import os
from typing import Optional

import torch

from megascale.checkpoint import ipc

log = logging.getLogger("megascale.checkpoint")


class HostBuffer:
    """Host memory in a memfd: the keeper maps the same pages, so handing a snapshot over
    copies nothing, and the pages live while either side holds the fd."""

    def __init__(self, size: int, fd: Optional[int] = None, pin: bool = False):
        if fd is None:
            fd = os.memfd_create("megascale-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd, self.size = fd, size
        # Populate now: faulting pages in during the first save would lengthen its stall.
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = pin and self._pin()

    def _pin(self) -> bool:
        # Page-locked memory lets device-to-host copies run as DMA at full bandwidth.
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, 0)
            return int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
        except Exception as e:  # pinning is an optimisation: copies still work unpinned
            log.warning("could not pin the %d-byte snapshot buffer: %s", self.size, e)
            return False

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = None
        ipc.close_mapping(self.map, self.fd)
