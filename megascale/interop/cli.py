"""`megascale export` (a checkpoint as a Hugging Face model directory) and `megascale import` (a
Hugging Face model directory as a job's step-0 checkpoint)."""
from __future__ import annotations

import argparse
import dataclasses
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("source", metavar="CHECKPOINT_OR_RUN",
                        help="a checkpoint uri, or a run directory (the checkpoint.uri of its config.yaml)")
    export.add_argument("--to", dest="format", choices=["hf"], required=True,
                        help="hf: config.json + safetensors + tokenizer, for transformers' from_pretrained")
    export.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    export.add_argument("--step", type=int, help="a committed step (default: the newest)")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file: bytes, or e.g. 5GB")
    export.add_argument("--no-tokenizer", action="store_true", help="write the model without the run's tokenizer")
    export.set_defaults(func=_export)

    imp = subparsers.add_parser("import", help="turn a Hugging Face model directory into a job's step-0 checkpoint")
    imp.add_argument("--from", dest="format", choices=["hf"], required=True,
                     help="hf: a transformers save_pretrained directory (config.json + safetensors)")
    imp.add_argument("directory", metavar="DIR")
    imp.add_argument("--config", required=True, help="the job YAML whose model and layout the checkpoint is for")
    imp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set parallelism.tp=2")
    imp.add_argument("out", metavar="OUT_CHECKPOINT", help="checkpoint uri to write (must hold no checkpoint)")
    imp.set_defaults(func=_import)


def _export(args: argparse.Namespace) -> int:
    from megascale.checkpoint import CheckpointError
    from megascale.interop.export import export_hf

    try:
        size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size  # bytes, or "5GB"
        print(export_hf(args.source, args.out, step=args.step, max_shard_size=size,
                        tokenizer=not args.no_tokenizer))
    except CheckpointError as e:
        print(f"CheckpointError: {e}", file=sys.stderr)
        return 1
    return 0


def _import(args: argparse.Namespace) -> int:
    from megascale.checkpoint import shutdown_keeper
    from megascale.config import load_config
    from megascale.interop.load import INIT_PREFIX, import_rank
    from megascale.launch import run_ranks
    from megascale.preflight import preflight
    from megascale.train import layout_of

    cfg = load_config(args.config, args.overrides)
    checkpoint = dataclasses.replace(cfg.checkpoint, uri=args.out, init_from=f"{INIT_PREFIX}{args.directory}",
                                     resume=False, every=0)
    cfg = preflight(dataclasses.replace(cfg, checkpoint=checkpoint), uri_field="OUT_CHECKPOINT",
                    when_held="import into a uri that holds none")
    try:
        run_ranks(import_rank, layout_of(cfg), cfg, sequence_parallel=cfg.parallelism.sequence_parallel,
                  backend=cfg.parallelism.backend, comm=cfg.comm)
    finally:
        shutdown_keeper(cfg.checkpoint.uri)  # nothing restores from host memory before the job starts
    p = cfg.parallelism
    print(f"{args.directory} -> step 0 checkpoint at {args.out} (tp={p.tp} pp={p.pp} vpp={p.vpp} dp={p.dp}); "
          "train from it with checkpoint.uri set to it and checkpoint.resume: true")
    return 0
