"""One rank of a job, as the executor starts it: `python -m megascale.executor.rank SPEC.json`.

Or `python -m megascale.executor.rank --standby`: a warm process that waits to become a rank (standby()).

Starts as every rank does (`megascale.rank.init_rank`, through the Redis rendezvous of this
incarnation), then runs the engine's `train_rank`. Progress goes to a JSON-lines file the executor tails; errors go to
stderr, which the executor scans.

With `control.restart: in_process` the process outlives its incarnation. The executor writes orders
to its stdin, one JSON object a line: `{"op": "leave"}` (the driver is stopping the ranks: abandon the
step, tear the process groups down) and `{"op": "join", "spec": PATH}` (the next incarnation's spec).
A rank that left says `{"state": "left"}` in its progress file; one whose incarnation failed under it
(an exception: a peer died, a collective failed) prints the error as an exiting process would and
says `{"state": "failed"}`. Either way it then waits for the next spec, keeping its interpreter,
imports, device context, model and optimizer (megascale.train.KeptTrainer: their allocations; the next
incarnation restores the newest checkpoint into them), and makes anew its groups and data source, with
its RNG streams put back to the state a new process starts with. End of stdin (the executor is gone)
ends it.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Optional

from megascale.common.lifetime import die_with_parent
from megascale.common.rankspec import STACKS_SIGNAL, Progress, RankSpec

if TYPE_CHECKING:  # torch's import waits until a rank needs it (a standby does it before its order)
    from megascale.train import KeptTrainer

RESIGNAL_S = 0.2  # how often the main thread is signalled again until it has left (see Orders._interrupt)
# A rank whose collective failed (a peer died, a connection broke) waits this long for the order to leave
# before it reports itself failed: the driver, told of the peer's fault, orders every rank out within ~1 s,
# and a rank reported failed first would be blamed for its peer's fault. No order: the failure is its own news.
COLLATERAL_WAIT_S = 5.0


class Leave(BaseException):
    """Raised in the main thread by the executor's order to leave the incarnation. A BaseException, so
    that no `except Exception` on the way (a retry loop, a best-effort clean-up) swallows it."""


class Orders:
    """The executor's orders, read from stdin on a thread of their own: the main thread may be blocked
    in a collective, in the rendezvous or on the checkpoint keeper when `leave` comes.

    `stage`: "joining" (a spec in hand, not yet training), "in" (training), "out" (left, failed or
    finished: waiting for a spec). Only the main thread moves it to "in" and "out"; a `leave` in
    "joining" or "in" interrupts it, one in "out" is only noted."""

    def __init__(self) -> None:
        from megascale.rank import abort_rank

        self._abort = abort_rank
        self.leave_ordered = threading.Event()  # since the current incarnation's spec came
        self.stage = "joining"
        self._is_out = threading.Event()
        self._specs: queue.Queue[Optional[str]] = queue.Queue()
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGUSR1, self._interrupt)
        threading.Thread(target=self._read, name="executor-orders", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            order = json.loads(line)
            if order["op"] == "leave":
                self.leave_ordered.set()
                if self.stage != "out":
                    self._abort()  # a collective blocked in gloo or NCCL fails now
                while self.stage != "out":  # a real signal, unlike interrupt_main: it cuts a system call short
                    signal.pthread_kill(self._main, signal.SIGUSR1)
                    self._is_out.wait(RESIGNAL_S)
            elif order["op"] == "join":
                self.leave_ordered.clear()
                self.stage = "joining"
                self._is_out.clear()
                self._specs.put(order["spec"])
        self._specs.put(None)

    def enter(self) -> None:
        """Main thread, first thing inside the incarnation's `try`."""
        self.stage = "in"
        if self.leave_ordered.is_set():  # ordered out before it began
            raise Leave()

    def leave(self) -> None:
        """Main thread: out of the incarnation, however it ended."""
        self.stage = "out"
        self._is_out.set()

    def _interrupt(self, signum: int, frame: object) -> None:
        # Not over an exception already unwinding the incarnation (a collective the abort made fail): that is
        # leaving it too, and raising here would cut its clean-up short. The next signal comes once it is done.
        if self.leave_ordered.is_set() and self.stage == "in" and sys.exc_info()[1] is None:
            self.leave()
            raise Leave()

    def next_spec(self) -> Optional[str]:
        """The next incarnation's spec path; None once the executor is gone."""
        return self._specs.get()


def answer_stack_requests() -> None:
    """Writes every thread's stack to stderr (fd 2: the rank's log, once it has one) at the executor's
    STACKS_SIGNAL, whatever the main thread is blocked in."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def main(argv: list[str]) -> int:
    answer_stack_requests()
    if argv == ["--standby"]:
        spec_path = standby()
        if spec_path is None:
            return 0
        argv = [spec_path]
    spec = RankSpec.load(argv[0])
    die_with_parent(spec.parent_pid)  # when the node dies, its ranks die with it
    from megascale.config import from_dict
    from megascale.train import KeptTrainer

    def progress_file() -> Progress:
        return Progress(spec.progress_path, from_dict(spec.config).logging.jsonl_max_bytes())

    if from_dict(spec.config).control.restart == "process":
        with contextlib.closing(progress_file()) as progress:
            run_incarnation(spec, progress)
        return 0
    orders, fresh, kept = Orders(), FreshState(), KeptTrainer()
    while True:
        with contextlib.closing(progress_file()) as progress:
            ended = run_incarnation(spec, progress, orders, fresh, kept)
            if ended is None:
                return 0
            release()
            progress.write({"state": ended})  # the executor may now hand it the next incarnation
        path = orders.next_spec()
        if path is None:
            return 0
        spec = RankSpec.load(path)


def standby() -> Optional[str]:
    """A warm process (executor/standby.py): does a new rank's imports, then waits for its first order and
    becomes that rank (its log, its environment); the spec's path, or None once the executor is gone."""
    die_with_parent(os.getppid())
    import torch
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (what a rank's first backward imports)

    import megascale.rank  # noqa: F401
    import megascale.train  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        return None
    order = json.loads(line)
    os.environ.update(order["env"])
    if "OMP_NUM_THREADS" in order["env"]:  # read at torch's import in a new process: too late here
        torch.set_num_threads(int(order["env"]["OMP_NUM_THREADS"]))
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    return order["spec"]


def run_incarnation(spec: RankSpec, progress: Progress, orders: Optional[Orders] = None,
                    fresh: Optional["FreshState"] = None, kept: Optional["KeptTrainer"] = None) -> Optional[str]:
    """Trains in `spec`'s incarnation. Without `orders` (control.restart: process) an error ends the process.
    With them, returns "left" once the rank left the incarnation at the executor's order, "failed" once
    it failed under it (either way ready for the next one), None when it trained to the end."""
    from megascale.config import from_dict
    from megascale.rank import abort_rank, init_rank, shutdown_rank
    from megascale.train import layout_of, train_rank

    cfg = from_dict(spec.config)
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(spec.world_size),
                      LOCAL_WORLD_SIZE=str(spec.local_world_size), MEGASCALE_INCARNATION=str(spec.incarnation))
    ctx, ended = None, None
    try:
        if orders is not None:
            orders.enter()
        ctx = init_rank(layout_of(cfg), spec.rank, spec.init_method, cfg.comm, backend=cfg.parallelism.backend,
                        sequence_parallel=cfg.parallelism.sequence_parallel, local_rank=spec.local_rank,
                        local_world_size=spec.local_world_size, flight_dir=spec.run_dir)
        if fresh is not None:
            fresh.apply(ctx.device)
        progress.write({"state": "running"})
        last = train_rank(ctx, cfg, spec.run_dir, on_step=progress.write,
                             on_start=lambda step: progress.write({"restored_step": step}),
                             on_wait=lambda what: progress.write({"waiting": what, "since": time.time()}),
                             kept=kept)
        if orders is not None:
            orders.leave()  # finishing: an order to leave now comes too late
        progress.write({"state": "done", **({"step": last["step"]} if last else {})})
        return None
    except BaseException as e:
        if orders is None:
            raise
        orders.leave()
        if not orders.leave_ordered.is_set():
            traceback.print_exc()  # as an exiting process would print it: the executor scans it for the cause
            if not _process_healthy(e):
                raise
            abort_rank()  # peers blocked on this rank fail now, as they would if it had exited
            if not (collateral(e) and orders.leave_ordered.wait(COLLATERAL_WAIT_S)):
                ended = "failed"
                return ended
        print(f"rank {spec.rank} left incarnation {spec.incarnation} at the executor's order (it was in "
              f"{_where(e)})", file=sys.stderr, flush=True)
        ended = "left"
        return ended
    finally:
        if ended is not None:
            abort_rank()
        shutdown_rank(ctx)


def _where(e: BaseException) -> str:
    """The function the rank was in when it had to leave, for the one line it prints about it."""
    where, tb = "?", e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:  # not Orders._interrupt, which raised it
            where = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return where


def _process_healthy(e: BaseException) -> bool:
    """Whether a process whose incarnation raised `e` can train on: not after an interrupt or exit, nor
    after a CUDA error, which leaves the device context unusable."""
    return isinstance(e, Exception) and "CUDA error" not in str(e)


def collateral(e: BaseException) -> bool:
    """Whether `e` is what a peer's fault does to this rank: its communication failed."""
    import torch.distributed as dist

    from megascale.executor.ranks import classify

    return isinstance(e, dist.DistError) or classify(str(e).strip().splitlines()[0] if str(e).strip() else "") \
        in ("comm_error", "nccl_timeout")


def release() -> None:
    """Frees what the incarnation left: its model, optimizer and buffers are garbage now (some in
    reference cycles), the device's cached blocks go back for a self-check or the next incarnation, and
    the host memory they held goes back to the system."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _trim_heap()


def _trim_heap() -> None:
    """Returns freed heap memory to the system: glibc keeps it in its arenas for reuse, and in-process
    incarnations reuse little of it. A 2-rank job of a 3.4M-parameter model grew each rank from 279 to
    526 MB over 6 incarnations without this, from 179 to 229 MB over 14 with it. Not glibc: nothing to do."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class FreshState:
    """The random streams (torch, CUDA, Python, NumPy) as this process had them before its first
    incarnation, put back before each later one: a rank that trains from step 0 again (no checkpoint
    yet) then draws what a newly started process would. A restored checkpoint sets its own."""

    def __init__(self) -> None:
        self.state: Optional[dict] = None

    def apply(self, device) -> None:
        from megascale.checkpoint import RngState

        rng = RngState(device)
        if self.state is None:
            self.state = rng.state_dict()
        else:
            rng.load_state_dict(self.state)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
