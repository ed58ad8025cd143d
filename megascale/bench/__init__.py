"""Benchmarks, one module per area, each with `run(args) -> dict` (a JSON-able report).

A top layer like the CLI: benchmarks may import the engine, driver and executor; nothing else in
megascale imports them.
"""

# `megascale bench NAME` -> module in this package.
BENCHMARKS = {
    "engine": "engine",
    "overlap": "overlap",
    "init": "rendezvous",
    "data": "data",
    "checkpoint": "checkpoint",
    "heartbeat": "heartbeat",
    "timers": "observability",
    "recovery": "recovery",
    "stragglers": "stragglers",
    "memory": "memory",
    "peers": "peers",
    "soak": "soak",
}


class BenchFailed(RuntimeError):
    """A benchmark could not finish (a job that never recovered, a worker that failed): `megascale bench`
    prints it as one line and exits 1."""
