"""A rank that restarts in process (control.restart: in_process) trains incarnation after incarnation in one
interpreter: each must leave nothing behind. Before the fix every incarnation kept its whole model and its gloo
process groups alive (3 threads and 5 fds more each, found by the soak's slopes): the parameters' gradient hooks
live in C++, where the garbage collector cannot see the cycle parameter -> hook -> gradient buffers -> parameter.
And what an incarnation freed must go back to the system: glibc kept it, ~75 MB a restart for a small model."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from megascale.checkpoint import shutdown_keeper
from megascale.config import from_dict
from megascale.executor.rank import release
from megascale.launch import run_ranks
from megascale.parallel.topology import Layout
from megascale.rank import init_rank, shutdown_rank
from megascale.train import layout_of, train_rank

from incarnation_support import threads_and_fds

INCARNATIONS = 3


def _incarnations(ctx, run_dir: str) -> list[tuple[int, int]]:
    """What this process holds after each of INCARNATIONS rounds of join -> train -> leave."""
    rank = ctx.rank
    shutdown_rank(ctx)  # run_ranks's own group: each incarnation below joins its own rendezvous
    cfg = from_dict({"model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                     "parallelism": {"dp": 2}, "batch": {"micro": 1, "global": 2}, "train": {"steps": 2},
                     "eval": {"every": 1},
                     "checkpoint": {"uri": f"{run_dir}/checkpoints", "every": 1}})
    held = []
    for incarnation in range(INCARNATIONS):
        ctx = init_rank(layout_of(cfg), rank, f"file://{run_dir}/rendezvous-{incarnation}", cfg.comm,
                        backend="gloo", threads=1)
        train_rank(ctx, cfg, run_dir)
        shutdown_rank(ctx)
        release()
        held.append(threads_and_fds())
    if rank == 0:
        shutdown_keeper(cfg.checkpoint.uri)  # it would serve this machine's ranks as long as pytest runs
    return held


def test_in_process_incarnations_leave_no_threads_or_descriptors_behind(tmp_path):
    for rank, held in enumerate(run_ranks(_incarnations, Layout(dp=2), str(tmp_path), backend="gloo")):
        threads = [n for n, _ in held]
        assert threads == [threads[0]] * INCARNATIONS, f"rank {rank}: threads after each incarnation {threads}"
        (_, first), (_, last) = held[0], held[-1]
        # One descriptor of the first incarnation may close late (a connection's peer going away); none is new.
        assert not Counter(last) - Counter(first), f"rank {rank}: descriptors kept {Counter(last) - Counter(first)}"


def _anon_mb() -> float:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["RssAnon"].split()[0]) / 1024


def test_what_an_incarnation_freed_goes_back_to_the_system():
    garbage = [bytes(1000) for _ in range(150_000)]  # 150 MB of small objects, as a model's state is
    kept = [bytes(1000) for _ in range(10)]  # allocated after it: the heap's top stays in use
    del garbage
    held = _anon_mb()
    release()  # glibc kept the freed pages below the top
    assert _anon_mb() < held - 100, f"{held:.0f} MB held before the release, {_anon_mb():.0f} MB after"
    assert kept
