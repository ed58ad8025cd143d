"""What `megascale run / launch / train` check on this machine before anything starts: a job that
cannot run fails here in one line, not after control.max_restarts identical crashes of its ranks."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

from megascale.config import ConfigError, JobConfig


def preflight(cfg: JobConfig, uri_field: str = "checkpoint.uri", when_held: Optional[str] = None) -> JobConfig:
    """`cfg` with data.path (and a data.tokenizer path) absolute, once its inputs exist and its
    checkpoint.uri is fit for a fresh start (or, resuming, holds a checkpoint of this model, which
    restores onto any parallelism); ConfigError naming the field otherwise. `uri_field` and `when_held`
    as in check_checkpoint_uri, for a command that takes the uri as an argument of its own."""
    from megascale.checkpoint import CheckpointError, check_checkpoint_uri
    from megascale.experiment_log import check_wandb

    if cfg.data.source != "synthetic" and cfg.data.path:
        _check_inputs(cfg, _existing("data.path", cfg.data.path))
    if cfg.eval.data:
        _existing("eval.data", cfg.eval.data)
    check_wandb(cfg)
    try:
        committed = check_checkpoint_uri(cfg.checkpoint.uri, cfg.checkpoint.resume, cfg.checkpoint.filesystem,
                                         cfg.checkpoint.filesystem_options, model=cfg.to_dict()["model"],
                                         field=uri_field, when_held=when_held)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if cfg.checkpoint.resume and committed == []:  # said here, not only in rank 0's log
        print(f"checkpoint.resume: no committed checkpoint under {cfg.checkpoint.uri} yet: starting from step 0",
              file=sys.stderr)
    if cfg.checkpoint.init_from:
        from megascale.interop import checked_init_from

        cfg = checked_init_from(cfg)
    return absolute_data_path(cfg)


def absolute_data_path(cfg: JobConfig) -> JobConfig:
    """`cfg` with a relative data.path, data.tokenizer and eval.data path made absolute from here:
    ranks and executors may run elsewhere."""
    from megascale.data.tokenizer import NAMES

    if cfg.data.source == "synthetic" or not cfg.data.path:
        return cfg
    tokenizer = cfg.data.tokenizer
    if tokenizer not in NAMES:
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    path = str(Path(cfg.data.path).expanduser().resolve())
    held_out = cfg.eval.data and str(Path(cfg.eval.data).expanduser().resolve())
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path, tokenizer=tokenizer),
                               eval=dataclasses.replace(cfg.eval, data=held_out or None))


def _existing(field: str, value: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative paths are from the current directory, {Path.cwd()})"
        raise ConfigError(f"{field}={value}: not found{where}")
    return path


def _check_inputs(cfg: JobConfig, path: Path) -> None:
    """What the ranks would otherwise find out one by one: no text to prepare, no prepared dataset,
    a tokenizer that is not one, or more token ids than the model has embeddings for."""
    from megascale.data import DataError
    from megascale.data.dataset import Dataset, sha256_bytes
    from megascale.data.prepare import list_inputs
    from megascale.data.tokenizer import BYTE_VOCAB, NAMES, load_pretrained

    data = cfg.data
    try:
        if data.source == "text":
            list_inputs([path])
            vocab = BYTE_VOCAB if data.tokenizer == "byte" else None  # a BPE is trained to model.vocab
        else:
            dataset = Dataset(path)
            vocab = dataset.vocab_size
    except DataError as e:
        raise ConfigError(f"data.path={data.path}: {e}") from None
    of = f"data.path={data.path} (data.tokenizer={data.tokenizer})"
    if data.tokenizer not in NAMES:
        try:
            tok = load_pretrained(_existing("data.tokenizer", data.tokenizer))
        except DataError as e:
            raise ConfigError(f"data.tokenizer={data.tokenizer}: {e}") from None
        if data.source == "text":
            vocab, of = tok.vocab_size, f"data.tokenizer={data.tokenizer}"
        elif dataset.manifest["tokenizer"].get("sha256") != sha256_bytes(tok.file_bytes):
            raise ConfigError(f"data.tokenizer={data.tokenizer}: not the tokenizer data.path={data.path} was "
                              "prepared with (its manifest.json records another)")
    if vocab is not None and vocab > cfg.model.vocab:
        raise ConfigError(f"model.vocab={cfg.model.vocab} is below the {vocab} token ids of {of}")
