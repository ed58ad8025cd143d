"""The Arrow memory pool of a driver process, chosen by the process that starts it, through its environment.

A driver writes and compacts the job's timings store (Parquet) for the whole job. pyarrow's default pool on
Linux, mimalloc, keeps the pages that compactions free: it grew the driver 36-84 MB/h in soaks (BENCHMARKS.md).
Arrow's Parquet reader and writer allocate from Arrow's C++ default pool, which reads ARROW_DEFAULT_MEMORY_POOL
once, when pyarrow loads; `pyarrow.set_memory_pool` after that reaches only what pyarrow's Python layer allocates.
So the choice must be in the environment the driver starts with.
"""
from __future__ import annotations

import os

from . import log

POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"
RETURNING_POOL = "jemalloc"  # in every Linux pyarrow wheel; a build without it: Arrow warns once, uses its default


def driver_environment() -> dict[str, str]:
    """This process's environment with the returning pool, unless it names a pool already: an operator's own
    choice stands."""
    env = dict(os.environ)
    env.setdefault(POOL_ENV, RETURNING_POOL)
    return env


def pool_in_use() -> str:
    """The pool Arrow allocates from in this process; a warning where nobody chose one (a driver started by
    hand, not by `megascale run` or the operator), since the default keeps freed pages."""
    import pyarrow as pa  # here, not at the top: the supervisor and the operator import this module without it

    name = pa.default_memory_pool().backend_name
    if POOL_ENV not in os.environ and name != RETURNING_POOL:
        log.warning("Arrow allocates from %s, which keeps the pages the timings store frees: start the driver "
                    "with %s=%s", name, POOL_ENV, RETURNING_POOL)
    return name
