"""`megascale bench data`: tree loading (one loader per node) vs every rank reading for itself.

One node of 4 rank processes (tp=2 x dp=2) trains on the shipped corpus with a simulated step
(a sleep: the GPU's forward/backward, which leaves the host CPU free). Each rank runs both modes in
turn: ranks_per_node=4 (one loader feeds all four) and ranks_per_node=1 (a loader per rank).
Reported: shard bytes the loaders read (per node) and the time a step spends inside next_batch.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import megascale.data

TP, DP = 2, 2
WORLD = TP * DP
SEQ, MICRO, MICROBATCHES = 1024, 1, 8
PREFETCH = 4
CORPUS = Path(megascale.data.__file__).resolve().parent / "corpus" / "python_docs.jsonl"  # shipped with megascale.data


def _rank(rank: int, dataset: str, run_dir: str, steps: int, step_s: float, barrier, queue) -> None:
    from megascale.data.source import (
        make_batch_source,  # torch comes in here, before any timing
    )

    cfg = SimpleNamespace(source="shards", path=dataset, seed=0, prefetch=PREFETCH, shuffle_window=4)
    for mode, per_node in (("tree", WORLD), ("every_rank", 1)):
        barrier.wait()  # both modes start together on an otherwise idle node
        t0 = time.perf_counter()
        src = make_batch_source(cfg, seq=SEQ, micro=MICRO, microbatches=MICROBATCHES, dp_rank=(rank // TP) % DP,
                                dp_size=DP, tp_rank=rank % TP, tp_size=TP, pp_rank=0, pp_size=1, global_rank=rank,
                                ranks_per_node=per_node, run_dir=f"{run_dir}/{mode}")
        startup = time.perf_counter() - t0
        waits, steps_s = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            src.next_batch()
            t1 = time.perf_counter()
            time.sleep(step_s)  # the model's step
            waits.append(t1 - t0)
            steps_s.append(time.perf_counter() - t0)
        stats = _settled(src, steps + PREFETCH)  # both modes end at the same point: ring refilled, next window read

        src.close()
        queue.put({"mode": mode, "rank": rank, "startup": startup, "waits": waits, "steps": steps_s,
                   "loader": stats["loader_pid"], "bytes_read": stats["bytes_read"]})


def _settled(src, batches: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = src.stats()
        if stats["batches"] >= batches and stats["idle"]:
            return stats
        time.sleep(0.01)
    raise RuntimeError(f"the data loader did not settle within {timeout:.0f} s: {stats}")


def _corpus(tmp: Path) -> Path:
    if CORPUS.is_file():
        return CORPUS
    from pydoc_data.topics import (
        topics,  # an installed copy without the repo's corpus: same kind of text
    )

    path = tmp / "reference.jsonl"
    path.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    return path


def run(args) -> dict:
    from megascale.data.prepare import prepare

    quick = bool(getattr(args, "quick", False))
    steps, step_s = (20, 0.1) if quick else (100, 0.2)
    with tempfile.TemporaryDirectory(prefix="megascale-bench-data-") as tmp:
        manifest = prepare([_corpus(Path(tmp))], Path(tmp) / "ds", shard_tokens=1 << 14)
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and torch state
        barrier, queue = ctx.Barrier(WORLD), ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, f"{tmp}/ds", tmp, steps, step_s, barrier, queue))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=300) for _ in range(2 * WORLD)]
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a benchmark rank failed: exit codes {[p.exitcode for p in procs]}")

    def summary(mode: str) -> dict:
        rows = [r for r in results if r["mode"] == mode]
        by_loader = {r["loader"]: r["bytes_read"] for r in rows}
        # The first batch pays for process start and the first window: reported apart from the steady state.
        fractions = [sum(r["waits"][1:]) / sum(r["steps"][1:]) for r in rows]
        return {
            "loaders": len(by_loader),
            "bytes_read_per_node": sum(by_loader.values()),
            "data_wait_fraction": max(fractions),
            "wait_ms_per_step_median": 1e3 * statistics.median(w for r in rows for w in r["waits"][1:]),
            "wait_ms_per_step_max": 1e3 * max(max(r["waits"][1:]) for r in rows),
            "first_batch_s": max(r["startup"] + r["waits"][0] for r in rows),
        }

    tree, every = summary("tree"), summary("every_rank")
    return {
        "data_wait_fraction": tree["data_wait_fraction"],
        "disk_read_ratio": tree["bytes_read_per_node"] / every["bytes_read_per_node"],
        "ranks_per_node": WORLD,
        "tree": tree,
        "every_rank": every,
        "setup": {"tp": TP, "dp": DP, "seq": SEQ, "micro": MICRO, "microbatches": MICROBATCHES, "steps": steps,
                  "step_s": step_s, "prefetch": PREFETCH, "corpus_tokens": manifest["tokens"],
                  "shards": len(manifest["shards"]), "quick": quick},
    }

