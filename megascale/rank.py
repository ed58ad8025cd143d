"""The one rank start-up: `init_rank` turns a process into rank R of a job, the same way for
`megascale train` (local processes), the executors' ranks and the benchmarks.

Its communication settings come from the job's `comm` section and nowhere else: `comm.timeout_s`
is the process group's timeout (gloo and NCCL) and the only time limit a rank has; a rank hung
for shorter than that is the driver's hang detector's business. `comm.env` goes over defaults
that make a broken link fail fast and loudly instead of hanging a collective forever, so the
driver can see the failure (MegaScale §4): NCCL retries InfiniBand transfers a bounded number of
times, and the PyTorch NCCL watchdog tears a rank down on a collective error or timeout rather
than leaving it blocked. Gloo has no such variables; its timeout is `comm.timeout_s`.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

import megascale.rendezvous  # noqa: F401  registers the redis:// init method
from megascale.common.comm_env import comm_env
from megascale.config import CommConfig
from megascale.parallel.flight_recorder import FlightRecorder
from megascale.parallel.topology import Layout, ParallelContext, build_context

def resolve_backend(choice: str) -> str:
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return choice


def init_rank(layout: Layout, rank: int, init_method: str, comm: CommConfig, *, backend: str = "auto",
              sequence_parallel: bool = False, local_rank: Optional[int] = None,
              local_world_size: Optional[int] = None, flight_dir: Optional[str | Path] = None,
              threads: Optional[int] = None) -> ParallelContext:
    """Makes this process rank `rank` of `layout`: communication environment, CPU threads, device,
    the process group from the rendezvous at `init_method` (`redis://...` or `file://...`), this
    rank's groups and timers, and, with `flight_dir`, its flight recorder. `threads`: intra-op threads
    (default: the node's cores shared by its `local_world_size` ranks, unless OMP_NUM_THREADS says).
    Undo with `shutdown_rank`."""
    os.environ.update(comm_env(comm.env, dict(os.environ)))
    local_rank = rank if local_rank is None else local_rank
    local_world_size = local_world_size or layout.world_size
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:  # the node's cores, shared by its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    backend = resolve_backend(backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=comm.timeout_s)
    if layout.world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world_size,
                                timeout=timeout)
    ctx = build_context(layout, rank, device, sequence_parallel, timeout)
    if flight_dir is not None:
        ctx.attach_recorder(FlightRecorder(Path(flight_dir) / f"flight-rank{rank}.bin"))
    return ctx


def abort_rank() -> None:
    """Breaks this process's communication off at once, from any thread and without its peers, so that
    every collective blocked in it fails instead of waiting out `comm.timeout_s` (an in-process restart
    leaves its incarnation this way). NCCL communicators are aborted. Gloo has no abort in torch 2.13
    (its backend's `abort()` is a no-op), so its TCP connections are shut down instead, which wakes a
    blocked collective with an error exactly as the death of this process would; the rendezvous
    store's connections go with them (a new incarnation opens its own). Follow with `shutdown_rank`.

    Not woken in gloo: a send whose bytes are already going out to a peer that stopped reading (gloo does
    not signal an unbound buffer in a connection's write queue); it waits out the group's timeout, which
    is why the executor stops a rank not out of its incarnation within seconds (docs/recovery.md)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile
            continue
        with sock:  # a duplicate: closing it leaves the original descriptor to its owner
            # Not a listening socket: gloo's listener thread ends the process (std::terminate) when its
            # accept() fails, and a connection shut down is all a blocked collective needs to fail.
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # not connected (yet)
                    pass


def shutdown_rank(ctx: Optional[ParallelContext] = None) -> None:
    """Leaves the job's process group, if this process joined one, and closes `ctx`'s flight recorder."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        # An init_process_group cut short (an in-process restart's order to leave, in the rendezvous) took its
        # group's name from torch's counter without registering a group, and only destroy_process_group resets
        # the counter. Left at 1, this process would name its next default group "1" where new processes say
        # "0", and gloo's connection keys of the two would never meet: the next incarnation hangs at its start.
        dist.distributed_c10d._world.group_count = 0
    recorder = ctx.tp.recorder if ctx is not None else None
    if recorder is not None:
        recorder.close()
