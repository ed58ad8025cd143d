"""Validation batches (eval.split or eval.data), read in the rank's own process.

A validation reads `eval.steps` batches every `eval.every` steps: too little to route through the node
loader, and the same batches every time, so that two validations' losses compare. Batch i holds held-out
sequences i*dp*rows .. (i+1)*dp*rows - 1, of which DP rank d takes its `rows`, as in training.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from megascale.data import DataError
from megascale.data.dataset import Dataset
from megascale.data.source import Batch, open_dataset, to_batch
from megascale.data.stream import Stream
from megascale.data.tokenizer import HF_FILE


class HeldOutSource:
    """Validation batch i for one rank; middle pipeline stages get empty batches (they read no tokens)."""

    def __init__(self, stream: Stream | None, *, rows: int, seq: int, dp_rank: int, dp_size: int) -> None:
        self.stream, self.rows, self.seq = stream, rows, seq
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def batch(self, index: int) -> Batch:
        if self.stream is None:
            empty = torch.empty((0, self.seq), dtype=torch.int64)
            return Batch(empty, empty, empty, empty)
        first = (index * self.dp_size + self.dp_rank) * self.rows
        return to_batch(*self.stream.read_sequences(first, self.rows, self.seq))


def _tokenizer_key(ds: Dataset) -> tuple:
    tok = ds.manifest["tokenizer"]
    return tok["vocab_size"], tok["eot_id"], tok.get("sha256")


def make_held_out_source(data_cfg: Any, eval_cfg: Any, *, seq: int, rows: int, dp_rank: int, dp_size: int,
                         pp_rank: int, pp_size: int, run_dir: str | os.PathLike,
                         vocab: int | None = None) -> HeldOutSource:
    """This rank's validation batches: eval.split of data.path's documents, or all of eval.data."""
    if pp_rank not in (0, pp_size - 1):
        return HeldOutSource(None, rows=rows, seq=seq, dp_rank=dp_rank, dp_size=dp_size)
    window = data_cfg.shuffle_window
    train = open_dataset(data_cfg.source, data_cfg.path, data_cfg.tokenizer, run_dir=run_dir, vocab=vocab)
    if eval_cfg.split:
        stream = Stream(train, data_cfg.seed, window, holdout=eval_cfg.split, read_held_out=True)
    else:
        # Text is tokenized with the training data's tokenizer (a BPE trained on it, or the pretrained one).
        same = str(train.root / HF_FILE) if train.manifest["tokenizer"].get("file") else "byte"
        held = open_dataset(data_cfg.source, eval_cfg.data, same, run_dir=run_dir, vocab=vocab)
        if _tokenizer_key(held) != _tokenizer_key(train):
            raise DataError(f"eval.data={eval_cfg.data}: prepared with another tokenizer than data.path="
                            f"{data_cfg.path}")
        stream = Stream(held, data_cfg.seed, window)
    try:
        stream.check_fill(seq, dp_size * rows)
    except DataError as e:
        raise DataError(f"held-out data ({'eval.split' if eval_cfg.split else 'eval.data'}): {e}") from None
    return HeldOutSource(stream, rows=rows, seq=seq, dp_rank=dp_rank, dp_size=dp_size)

