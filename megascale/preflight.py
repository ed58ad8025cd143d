"""What `megascale run / launch / train` check on this machine before anything starts: a job that
cannot run fails here in one line, not after control.max_restarts identical crashes of its ranks."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megascale.config import ConfigError, JobConfig


def preflight(cfg: JobConfig) -> JobConfig:
    """`cfg` with data.path absolute, once its inputs exist and its checkpoint.uri is fit for a fresh
    start; ConfigError naming the field otherwise."""
    from megascale.checkpoint import CheckpointError, check_fresh_start

    if cfg.data.source != "synthetic" and cfg.data.path:
        path = Path(cfg.data.path).expanduser()
        if not path.exists():
            where = "" if path.is_absolute() else f" (relative paths are from the current directory, {Path.cwd()})"
            raise ConfigError(f"data.path={cfg.data.path}: not found{where}")
        _check_inputs(cfg, path)
    try:
        check_fresh_start(cfg.checkpoint.uri, cfg.checkpoint.resume, cfg.checkpoint.filesystem)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return absolute_data_path(cfg)


def absolute_data_path(cfg: JobConfig) -> JobConfig:
    """`cfg` with a relative data.path made absolute from here: ranks and executors may run elsewhere."""
    if cfg.data.source == "synthetic" or not cfg.data.path:
        return cfg
    path = str(Path(cfg.data.path).expanduser().resolve())
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))


def _check_inputs(cfg: JobConfig, path: Path) -> None:
    """What the ranks would otherwise find out one by one: no text to prepare, no prepared dataset,
    or more token ids than the model has embeddings for."""
    from megascale.data import DataError
    from megascale.data.dataset import Dataset
    from megascale.data.prepare import list_inputs
    from megascale.data.tokenizer import BYTE_VOCAB

    try:
        if cfg.data.source == "text":
            list_inputs([path])
            vocab = BYTE_VOCAB if cfg.data.tokenizer == "byte" else None  # a BPE is trained to model.vocab
        else:
            vocab = Dataset(path).vocab_size
    except DataError as e:
        raise ConfigError(f"data.path={cfg.data.path}: {e}") from None
    if vocab is not None and vocab > cfg.model.vocab:
        raise ConfigError(f"model.vocab={cfg.model.vocab} is below the {vocab} token ids of data.path={cfg.data.path} "
                          f"(data.tokenizer={cfg.data.tokenizer})")
