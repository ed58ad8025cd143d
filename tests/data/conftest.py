"""Small deterministic corpora and a helper that builds every rank's BatchSource in this process."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from megascale.data import make_batch_source
from megascale.data.prepare import prepare

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "omicron", "pi", "rho"]


def write_corpus(folder: Path, docs: int = 60, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 60))]
        (folder / f"doc{i:03d}.txt").write_text(f"document {i}: " + " ".join(words) + "\n")
    return folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text")


@pytest.fixture(scope="session")
def dataset(corpus, tmp_path_factory) -> Path:
    """~60 documents, ~15k byte tokens in ~10 shards of ~1500 tokens."""
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare([corpus], out, shard_tokens=1500)
    return out


def data_cfg(path, source: str = "shards", seed: int = 7, **extra) -> SimpleNamespace:
    return SimpleNamespace(source=source, path=str(path), seed=seed, prefetch=extra.pop("prefetch", 3),
                           shuffle_window=extra.pop("shuffle_window", 3), **extra)


@pytest.fixture
def sources(tmp_path):
    """sources(path, tp=, dp=, pp=, ...) -> every rank's source in global-rank order; all closed at teardown."""
    made = []

    def build(path, *, tp=1, dp=1, pp=1, micro=2, microbatches=2, seq=16, seed=7, ranks_per_node=None,
              run_dir=None, source="shards", vocab=None, **extra):
        cfg = data_cfg(path, source=source, seed=seed, **extra)
        out = []
        for rank in range(tp * dp * pp):  # ascending: each node's loader-starting rank comes first
            out.append(make_batch_source(
                cfg, seq=seq, micro=micro, microbatches=microbatches,
                dp_rank=(rank // tp) % dp, dp_size=dp, tp_rank=rank % tp, tp_size=tp,
                pp_rank=rank // (tp * dp), pp_size=pp, global_rank=rank, ranks_per_node=ranks_per_node,
                run_dir=run_dir or tmp_path / "run", vocab=vocab))
            made.append(out[-1])
        return out

    yield build
    for s in reversed(made):
        s.close()
