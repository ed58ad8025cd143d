"""What a node's data loader keeps as it serves: one loader of the soak's data (the shipped corpus, packed to the
soak's sequence and batch) serves `batches` batches to one consumer as fast as it packs them, many epochs of
the corpus, and its memory is read every 1,000 batches.

A faulted soak starts a node's loader anew with each incarnation, so no loader lives the minutes a time slope
needs. Counted per batch served, a leak in what the loader does per batch shows anyway: 100,000 batches are
more than a day of the soak's job (a batch per node per step, about one step a second).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import psutil

from megascale.bench.soak_fits import anon_mb, growth_per_100

EVERY = 1000  # batches between reads: growth per 100 reads is growth per 100,000 batches


def loader_memory(batches: int = 100_000) -> dict:
    from megascale.bench.soak import job_config
    from megascale.config import from_dict
    from megascale.data import make_batch_source

    with tempfile.TemporaryDirectory(prefix="megascale-bench-loader-") as root:
        cfg = from_dict(job_config(Path(root), steps=1))
        before = {p.pid for p in psutil.Process().children()}
        source = make_batch_source(cfg.data, seq=cfg.model.seq, micro=cfg.batch.micro,
                                   microbatches=cfg.microbatches, dp_rank=0, dp_size=cfg.parallelism.dp,
                                   tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, global_rank=0, ranks_per_node=1,
                                   run_dir=cfg.train.run_dir, vocab=cfg.model.vocab)
        try:
            loader = next(p for p in psutil.Process().children() if p.pid not in before)  # the leader's
            anon, rss, started = [], [], time.monotonic()
            for served in range(1, batches + 1):
                source.next_sample()
                if served % EVERY == 0:
                    memory = loader.memory_info()
                    anon.append(round(anon_mb(memory), 2))
                    rss.append(round(memory.rss / 2**20, 2))
            elapsed = time.monotonic() - started
        finally:
            source.close()
    return {"batches": batches, "batches_per_s": round(batches / elapsed), "every": EVERY, "anon_mb": anon,
            "rss_mb": rss, "anon_mb_per_100k_batches": growth_per_100(anon),
            "rss_mb_per_100k_batches": growth_per_100(rss)}
