"""The memory allocator of the rank processes an executor starts: jemalloc, preloaded, where the node has it.

Under glibc's malloc a rank's main heap grows 5-20 MB over its first ~20 minutes of training before it settles
(BENCHMARKS.md, Soak: "where the ranks' growth sits"); neither trimming it nor capping glibc's arenas stopped that.
Under jemalloc the same ranks stay within a few MB from their third minute on, ~40 MB smaller, at the same step
time (BENCHMARKS.md, Soak: "the ranks on jemalloc"). PyTorch's own CPU launcher (torch.backends.xeon.run_cpu)
preloads it for the same reasons. The choice is the node's, not the job's: an executor's warm standby processes
start before any job's config reaches it. `MEGASCALE_RANK_MALLOC=system` in the executor's environment keeps
glibc's; a job's `comm.env` that sets LD_PRELOAD itself replaces this one.
"""
from __future__ import annotations

import ctypes.util
import functools
import os

from . import log

MALLOC_ENV = "MEGASCALE_RANK_MALLOC"
CHOICES = ("jemalloc", "system")


class AllocatorError(ValueError):
    """MEGASCALE_RANK_MALLOC names no allocator; one line."""


@functools.cache
def rank_allocator_env() -> dict[str, str]:
    """What to add to a rank process's environment for its allocator; empty for glibc's."""
    wanted = os.environ.get(MALLOC_ENV, "jemalloc")
    if wanted not in CHOICES:
        raise AllocatorError(f"{MALLOC_ENV}={wanted!r}: must be one of {', '.join(CHOICES)}")
    if wanted == "system":
        log.info("rank processes use glibc's malloc (%s=system)", MALLOC_ENV)
        return {}
    library = ctypes.util.find_library("jemalloc")  # its soname, which the dynamic linker resolves as for any library
    if library is None:
        log.warning("rank processes use glibc's malloc: jemalloc is not installed on this node "
                    "(Debian/Ubuntu: apt-get install libjemalloc2)")
        return {}
    log.info("rank processes use jemalloc (%s)", library)
    inherited = os.environ.get("LD_PRELOAD")
    return {"LD_PRELOAD": f"{inherited}:{library}" if inherited else library}
